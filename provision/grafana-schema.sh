#!/usr/bin/env bash
# Installs @grafana/schema and TypeScript once per machine into ~/.cache/gpuslo/grafana-schema
# (from the npm registry, versions pinned in grafana-schema/package.json) and prints that directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=${GPUSLO_CACHE:-$HOME/.cache/gpuslo}/grafana-schema
if [ ! -f "$dest/.complete" ] || ! cmp -s "$here/grafana-schema/package.json" "$dest/package.json"; then
  command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm; }
  rm -rf "$dest" && mkdir -p "$dest"
  cp "$here/grafana-schema/package.json" "$dest/"
  (cd "$dest" && npm install --silent --no-audit --no-fund >&2)
  touch "$dest/.complete"
fi
echo "$dest"
