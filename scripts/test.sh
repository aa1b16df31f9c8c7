#!/usr/bin/env bash
# Installs what the test suite needs on a fresh machine, then runs lint, types and every test.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k wire`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# ClickHouse 24.8 (the oldest server we support) embedded: chDB 2.1.1, in a venv of its own
if [ ! -x .venv-ch24/bin/python ]; then
  "$PY" -m venv .venv-ch24
fi
.venv-ch24/bin/python -m pip install -q --disable-pip-version-check chdb==2.1.1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
GPUSLO_REQUIRE_CH24=1 .venv/bin/python -m pytest "$@"
