"""The generated dashboards type-check against Grafana's published dashboard model: the
``Dashboard`` type of the npm package @grafana/schema, compiled with TypeScript in strict
mode (excess-property checks catch fields Grafana does not know)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gpuslo.dashboards.generate import render
from gpuslo.rules.config import example

ROOT = Path(__file__).resolve().parents[1]

HEAD = """import type { Dashboard } from '@grafana/schema';
// Grafana's schema types some string fields as TypeScript enums; JSON holds their values.
type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[] : T extends object ? { [K in keyof T]: Json<T[K]> } : T;
"""


@pytest.fixture(scope="module")
def schema_dir() -> Path:
    r = subprocess.run(
        ["bash", str(ROOT / "provision/grafana-schema.sh")], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        pytest.fail(f"provision/grafana-schema.sh failed: {r.stderr[-2000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


BROKEN = "broken.ts"  # a dashboard with a field Grafana does not know: the check is not vacuous


@pytest.fixture(scope="module")
def checked(schema_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One TypeScript run over every dashboard (a file each) and a broken one: the errors per
    file ("" for none), and under "" those that name no file (a run that did not check)."""
    work = tmp_path_factory.mktemp("tsc")
    bodies = {f"{Path(name).stem}.ts": text for name, text in render(example()).items()}
    d = json.loads(render(example())["slo.json"])
    d["panels"][0]["notAGrafanaField"] = 1
    bodies[BROKEN] = json.dumps(d)
    for f, text in bodies.items():
        (work / f).write_text(HEAD + f"export const dash: Json<Dashboard> = {text};\n")
    (work / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "module": "esnext", "moduleResolution": "bundler",
                            "target": "es2020", "skipLibCheck": True, "typeRoots": [], "baseUrl": ".",
                            "paths": {"@grafana/schema": [str(schema_dir / "node_modules/@grafana/schema")]}},
        "files": sorted(bodies),
    }))  # fmt: skip
    r = subprocess.run(
        [str(schema_dir / "node_modules/.bin/tsc"), "-p", str(work)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=work,
    )  # fmt: skip (cwd: errors name the file alone)
    errors = dict.fromkeys([*bodies, ""], "")
    current = ""
    for line in (r.stdout + r.stderr).splitlines():
        head = line.split("(", 1)[0]
        if not line.startswith(" "):  # an error's first line names its file; the rest is indented
            current = head if head in bodies else ""
        errors[current] += line + "\n"
    return errors


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
@pytest.mark.parametrize("name", sorted(render(example())))
def test_dashboard_matches_grafana_schema(name: str, checked: dict[str, str]) -> None:
    assert (checked[f"{Path(name).stem}.ts"], checked[""]) == ("", ""), checked[""][-3000:]


@pytest.mark.integration  # slow (over 0.7 s): the fast tier stays a loop under a minute
def test_the_check_can_fail(checked: dict[str, str]) -> None:
    """An unknown panel field is reported, in the file that has it."""
    assert "notAGrafanaField" in checked[BROKEN]
