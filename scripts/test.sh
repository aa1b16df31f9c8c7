#!/usr/bin/env bash
# Installs what the test suite needs on a fresh machine, then runs lint, types and every test:
# Python deps in .venv; ClickHouse 24.8 (chDB 2.1.1) in .venv-ch24; Debian's clickhouse-server
# (native-protocol peer), Java and Maven (for the Kafka broker), Slurm and munge, Alertmanager
# promtool and Chromium (to render the HTML report) via apt-get when missing;
# the Apache Kafka broker jars from Maven Central and @grafana/schema + TypeScript from npm into
# ~/.cache/gpuslo (provision/kafka.sh, provision/grafana-schema.sh); etcd, kube-apiserver,
# kube-scheduler and kube-controller-manager built once from the Go module proxy into
# ~/.cache/gpuslo (provision/k8s.sh), and Kueue's controller manager with its CRDs
# (provision/kueue.sh).
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k wire`).
# Where a Docker engine runs, GPUSLO_TEST_SERVERS=containers starts the integration servers from the
# compose file's images instead and adds the container-only tests (docs/development.md, "Where Docker
# exists"); without one those are skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need=()
command -v clickhouse-server >/dev/null || [ -x /usr/sbin/clickhouse-server ] || need+=(clickhouse-server)
command -v java >/dev/null || need+=(default-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v promtool >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

bash provision/grafana-schema.sh >/dev/null  # (may apt-get npm: before the Go builds start theirs)
# the Go builds of the control plane and Kueue (minutes of CPU on a fresh machine, nothing once
# cached) run while pip and Maven download; no apt-get runs here after this point but theirs
# (kafka.sh's java and mvn are in the list above)
go_log=$(mktemp)
(bash provision/k8s.sh >/dev/null && bash provision/kueue.sh >/dev/null) 2>"$go_log" &
go_builds=$!

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check pip==26.3
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[all,test]'
if [ ! -x .venv-ch24/bin/python ]; then
  "$PY" -m venv .venv-ch24
fi
.venv-ch24/bin/python -m pip install -q --disable-pip-version-check chdb==2.1.1
bash provision/kafka.sh >/dev/null
if ! wait "$go_builds"; then
  cat "$go_log" >&2
  echo "scripts/test.sh: building the Kubernetes control plane or Kueue failed (above)" >&2
  exit 1
fi
rm -f "$go_log"

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache  # the layer contract in pyproject.toml
# three workers (pytest-xdist) on CI's two cores, each taking whole test files (the servers a module
# starts stay its own): two kept the cores 66 % busy, the fault tests waiting on servers; three, 94 %
# (docs/development.md). Files start longest first (tests/ordering.py, tests/durations.json), not by
# their number of tests. GPUSLO_TEST_WORKERS=0 runs them in one process
GPUSLO_REQUIRE_CH24=1 GPUSLO_REQUIRE_K8S=1 .venv/bin/python -m pytest \
  -n "${GPUSLO_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
