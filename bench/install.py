"""Installed size of each role: a fresh virtualenv per extra (`gpuslo[agent]`, `gpuslo[all]`, ...)
with this checkout installed by pip exactly as a user would (`pip install -c constraints.txt
'gpuslo[EXTRA]'`, not editable), then the size of its site-packages and the distributions in it.

The pinned wheels are fetched from the registry once into ~/.cache/gpuslo/wheels and installed from
there (`--no-index`), so a rerun needs no network and always installs the same bytes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path.home() / ".cache" / "gpuslo" / "wheels"
# pip and setuptools come with every venv of Python 3.11 (python -m venv), whatever is installed
VENV_OWN = frozenset({"pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth"})


class InstallError(RuntimeError):
    """pip could not install the extra (its output says why)."""


def copy_source(dst: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, not ignored; links kept), so no
    build output, venv or cache of the working tree goes into the install."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    dst.mkdir(parents=True, exist_ok=True)
    archive = dst.parent / f"{dst.name}.tar"
    with tarfile.open(archive, "w") as tar:
        for name in filter(None, listed):
            path = ROOT / os.fsdecode(name)
            if path.exists() or path.is_symlink():
                tar.add(path, arcname=os.fsdecode(name), recursive=False)
    with tarfile.open(archive) as tar:
        tar.extractall(dst, filter="tar")
    archive.unlink()
    return dst


def requirements(extras: tuple[str, ...]) -> list[str]:
    """The project's requirements for `extras` (gpuslo[...] inside an extra expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs, todo, done = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for r in project["optional-dependencies"][extra]:
            if r.startswith("gpuslo["):
                todo += r[len("gpuslo[") : r.index("]")].split(",")
            else:
                reqs.append(r)
    return sorted(set(reqs))


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": ""}
    return subprocess.run(
        [str(python), "-m", "pip", *args], capture_output=True, text=True, env=env, check=False, timeout=1800
    )


def make_venv(extras: tuple[str, ...], where: Path) -> Path:
    """A new virtualenv under `where` with gpuslo[extras] installed from a copy of the checkout;
    returns its python. Raises InstallError with pip's own words when it cannot."""
    src = copy_source(where / "src")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    constraints = str(src / "constraints.txt")
    target = f"{src}[{','.join(extras)}]" if extras else str(src)
    offline = ("install", "-q", "--no-index", "--find-links", str(WHEELS), "-c", constraints, target)
    if WHEELS.is_dir() and _pip(python, *offline).returncode == 0:
        return python
    # first run (or a new pin): fetch the pinned wheels once, and the build backend
    WHEELS.mkdir(parents=True, exist_ok=True)
    got = _pip(
        python,
        "download",
        "-q",
        "-d",
        str(WHEELS),
        "-c",
        constraints,
        *requirements(extras),
        "setuptools>=68",
    )
    if got.returncode != 0:
        raise InstallError(f"pip download into {WHEELS} failed:\n{got.stderr[-4000:]}")
    done = _pip(python, *offline)
    if done.returncode != 0:
        raise InstallError(f"pip install {target} failed:\n{done.stderr[-4000:]}")
    return python


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def installed(python: Path) -> dict[str, str]:
    """Distribution name -> version, as pip lists them."""
    out = _pip(python, "list", "--format", "json")
    return {d["name"]: d["version"] for d in json.loads(out.stdout)}


def _dir_mb(path: Path) -> float:
    if path.is_file():
        return path.stat().st_size / 1e6
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def size_mb(site: Path, skip: frozenset[str] = frozenset()) -> float:
    """Bytes of the files under `site` (MB), leaving out the top-level entries named in `skip`
    (and their `NAME-VERSION.dist-info`)."""
    return sum(_dir_mb(p) for p in site.iterdir() if p.name not in skip and p.name.split("-")[0] not in skip)


def measure(extra: str, where: Path) -> dict[str, object]:
    """Install gpuslo[extra] into a venv under `where` and describe its site-packages."""
    python = make_venv((extra,) if extra else (), where)
    sp = site_packages(python)
    ours = sorted(n for n in installed(python) if n.lower() not in VENV_OWN)
    sizes = sorted(((p.name, round(_dir_mb(p), 1)) for p in sp.iterdir()), key=lambda x: -x[1])
    return {
        "extra": extra,
        "site_packages_mb": round(size_mb(sp), 1),
        "without_pip_setuptools_mb": round(size_mb(sp, VENV_OWN), 1),
        "distributions": ours,
        "largest_mb": dict(sizes[:6]),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench install", description=__doc__)
    ap.add_argument(
        "--extras", default="agent,all", help="extras to measure, comma-separated ('' = plain gpuslo)"
    )
    ap.add_argument("--keep", help="build the venvs under this directory and keep them")
    a = ap.parse_args(argv)
    rows = []
    for extra in a.extras.split(","):
        where = (
            Path(a.keep) / (extra or "core") if a.keep else Path(tempfile.mkdtemp(prefix="gpuslo-install-"))
        )
        try:
            row = measure(extra, where)
        except InstallError as exc:
            print(exc, file=sys.stderr)
            return 2
        finally:
            if not a.keep:
                shutil.rmtree(where, ignore_errors=True)
        rows.append(row)
        label = f"gpuslo[{extra}]" if extra else "gpuslo"
        print(
            f"{label}: site-packages {row['site_packages_mb']} MB ({row['without_pip_setuptools_mb']} MB "
            f"without pip/setuptools), largest {row['largest_mb']}; distributions: {', '.join(row['distributions'])}"  # type: ignore[arg-type]
        )
    print(json.dumps({"bench": "install", "rows": rows}))
    return 0
