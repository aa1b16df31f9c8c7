"""The README is a newcomer's first screen with a map into docs/, every link in it and in docs/ lands,
and the repository root holds only what belongs there."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FIRST_SCREEN_LINES = 60
SETUP_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[all]' && .venv/bin/gpuslo demo",
    "bash scripts/test.sh",
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ROOT_FILES = {
    ".dockerignore",
    ".gitignore",
    "Dockerfile",
    "README.md",
    "constraints.txt",
    "docker-compose.yml",
    "pyproject.toml",
}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_first_screen_has_the_setup_commands_and_the_map() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES])
    for command in SETUP_COMMANDS:
        assert f"\n{command}\n" in first, f"set-up command not on the README's first screen: {command}"
    assert "## What the demo shows" in first
    assert "## Where to go next" in first


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {t.split("#", 1)[0] for t in LINK.findall((ROOT / "README.md").read_text())}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages, "no docs/ pages"
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"
    for must in ("docs/benchmarks.md", "docs/verification.md"):
        assert must in pages


def test_the_readme_says_what_is_verified_against_fakes() -> None:
    text = (ROOT / "README.md").read_text()
    assert "verified against fakes" in text
    assert "not run on a GPU" in text


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_lands(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: {broken}"


def test_slug_follows_github() -> None:
    # GitHub's own anchors for these headings (read off the rendered page)
    assert _slug("The demo's options and JSON") == "the-demos-options-and-json"
    assert _slug("The node agent on real GPUs (NVML)") == "the-node-agent-on-real-gpus-nvml"
    assert _slug("Replaying real data: `ingest --file` and `rules eval`") == (
        "replaying-real-data-ingest---file-and-rules-eval"
    )


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_no_stray_files_are_committed() -> None:
    tracked = _tracked()
    at_root = {f for f in tracked if "/" not in f}
    assert at_root - ROOT_FILES == set(), (
        f"unexpected files at the repository root: {sorted(at_root - ROOT_FILES)}"
    )
    job_outputs = [f for f in tracked if re.search(r"(^|/)slurm-\d+\.out$", f)]
    assert not job_outputs, f"Slurm job outputs committed: {job_outputs}"


def test_slurm_jobs_write_into_the_cluster_directory() -> None:
    """sbatch writes slurm-%j.out into its working directory (the checkout) unless told where: every
    sbatch call of the tests names an --output under the cluster's own directory."""
    calls = []
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r'"sbatch"', text):
            call = text[m.start() : text.find(")", text.find('"--wrap"', m.start()))]
            calls.append((path.name, call))
    calls = [(name, call) for name, call in calls if name != "test_docs.py"]
    assert calls, "no sbatch call found in the tests"
    for name, call in calls:
        assert re.search(r"--output=\{(?:self|slurm)\.dir\}/", call), (
            f"{name}: sbatch without --output in the cluster directory"
        )
