#!/usr/bin/env bash
# Here, before a device check (scripts/device-check.sh): the wheels the agent's NVML checks need
# that the GPU machine's image lacks or holds in other versions (it reaches no package index),
# at the versions of constraints.txt, for its Python (3.12 on the lent machines: PYVER to change),
# into .whl/ (.gitignore'd: a `run` carries it with carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PY=${PYTHON:-python3}
pins=$(grep -iE '^(pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions|orjson|nvidia-ml-py|prometheus_client)==' constraints.txt || true)
[ -n "$pins" ] && [ "$(echo "$pins" | wc -l)" -eq 8 ] || { echo "scripts/device-wheels.sh: expected 8 pins in constraints.txt, got: $pins" >&2; exit 1; }
rm -rf .whl
mkdir -p .whl
# shellcheck disable=SC2086  # one pin per word
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
du -sh .whl
