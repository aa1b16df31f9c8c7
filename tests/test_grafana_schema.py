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


def _tsc(schema_dir: Path, work: Path, body: str) -> subprocess.CompletedProcess[str]:
    (work / "check.ts").write_text(HEAD + body)
    (work / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "module": "esnext", "moduleResolution": "bundler",
                            "target": "es2020", "skipLibCheck": True, "typeRoots": [], "baseUrl": ".",
                            "paths": {"@grafana/schema": [str(schema_dir / "node_modules/@grafana/schema")]}},
        "files": ["check.ts"],
    }))  # fmt: skip
    return subprocess.run([str(schema_dir / "node_modules/.bin/tsc"), "-p", str(work)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


@pytest.mark.parametrize("name", sorted(render(example())))
def test_dashboard_matches_grafana_schema(name: str, schema_dir: Path, tmp_path: Path) -> None:
    text = render(example())[name]
    r = _tsc(schema_dir, tmp_path, f"export const dash: Json<Dashboard> = {text};\n")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_the_check_can_fail(schema_dir: Path, tmp_path: Path) -> None:
    """An unknown panel field is reported: the check is not vacuous."""
    d = json.loads(render(example())["slo.json"])
    d["panels"][0]["notAGrafanaField"] = 1
    r = _tsc(schema_dir, tmp_path, f"export const dash: Json<Dashboard> = {json.dumps(d)};\n")
    assert r.returncode != 0 and "notAGrafanaField" in r.stdout
