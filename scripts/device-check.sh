#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (the device tool's `run`, which sets OUT; elsewhere OUT defaults
# to ./device-out): what the agent's NVML source reads there and what it costs, in one short run.
#   here:  bash scripts/device-wheels.sh
#   there: run(command="bash scripts/device-check.sh", carry=[".whl"], timeout_s=420)
# It installs the carried wheels (WHEELS, .whl/, if any) into SITE (/tmp/site), then writes under $OUT:
#   nvidia-smi.txt   the GPUs, driver and CUDA version as nvidia-smi sees them
#   once.json        `gpuslo agent --source nvml --once --print`: one tick's messages, real NVML
#   once.err         its stderr (GPUs, unsupported fields, errors, lost)
#   bench-agent.txt  `python -m bench agent --nvml real --ticks TICKS` (1000): the real NVML's CPU
#                    per 1,000 ticks and peak RSS beside the fake's at 8 GPUs and shaped as the real
#   pip.txt          the wheels' install, where there were wheels
# OUT, WHEELS and SITE relative to the repository's root.
# Every step runs whatever the one before did; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
TICKS=${TICKS:-1000}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if ! mkdir -p "$OUT" || [ ! -w "$OUT" ]; then
  echo "scripts/device-check.sh: cannot write under OUT=$OUT" >&2
  exit 2
fi
rc=0
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$OUT/pip.txt" 2>&1 || { rc=$?; cat "$OUT/pip.txt"; }
  export PYTHONPATH=$SITE:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
{ "$PY" --version; uname -a; nvidia-smi; nvidia-smi -q | grep -iE 'product name|driver version|cuda version|mig mode|nvlink' | head -40; } \
  >"$OUT/nvidia-smi.txt" 2>&1 || true  # informational: the checks below say what failed
timeout 120 "$PY" -m gpuslo agent --source nvml --once --print --metrics-port 0 >"$OUT/once.json" 2>"$OUT/once.err"
s=$?; [ $s -ne 0 ] && [ $rc -eq 0 ] && rc=$s
timeout 300 "$PY" -m bench agent --nvml real --ticks "$TICKS" >"$OUT/bench-agent.txt" 2>&1
s=$?; [ $s -ne 0 ] && [ $rc -eq 0 ] && rc=$s
for f in nvidia-smi.txt once.err bench-agent.txt; do echo "=== $f"; tail -n 40 "$OUT/$f"; done
echo "=== once.json: $(wc -c <"$OUT/once.json") bytes"; head -c 1500 "$OUT/once.json"; echo
exit $rc
