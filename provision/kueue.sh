#!/usr/bin/env bash
# Builds Kueue's controller manager once per machine from the Go module proxy and prints the
# directory holding it: bin/kueue (sigs.k8s.io/kueue/cmd/kueue, built from the released module
# with the versions its own go.mod pins), crd/ (the CustomResourceDefinitions of
# config/components/crd/bases) and webhook/ (config/components/webhook/manifests.yaml, the
# admission webhooks the manager serves), both copied from the same module.
#
# sigs.k8s.io/kueue's go.mod has no replace directives, so `go install module/cmd@version` builds
# it as released; the script checks that before relying on it.
#
# Cache: ${GPUSLO_CACHE:-~/.cache/gpuslo}/kueue-VERSION (reused when .complete is there).
set -euo pipefail
version=${GPUSLO_KUEUE_VERSION:-v0.17.0}
cache=${GPUSLO_CACHE:-$HOME/.cache/gpuslo}
dest=$cache/kueue-$version
if [ -f "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi
# one build at a time (test runs in parallel); the one that waited finds it done
mkdir -p "$cache"
exec 9>"$cache/.kueue-$version.lock"
flock 9
if [ -f "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi
if ! command -v go >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq golang-go >/dev/null
fi
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/crd" "$dest/webhook"
started=$(date +%s)

# `go mod download` needs a module context only for its cache: run it outside any module
cd "$dest"
info=$(go mod download -json "sigs.k8s.io/kueue@$version")
moddir=$(printf '%s\n' "$info" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
[ -d "$moddir" ] || { echo "provision/kueue.sh: could not download sigs.k8s.io/kueue@$version" >&2; exit 1; }
if grep -q '^[[:space:]]*replace\b' "$moddir/go.mod"; then
  echo "provision/kueue.sh: $moddir/go.mod has replace directives; go install cannot build it" >&2
  exit 1
fi
bases=$moddir/config/components/crd/bases
[ -f "$bases/kueue.x-k8s.io_workloads.yaml" ] || { echo "provision/kueue.sh: no CRDs in $bases" >&2; exit 1; }
cp "$bases"/*.yaml "$dest/crd/"
cp "$moddir/config/components/webhook/manifests.yaml" "$dest/webhook/manifests.yaml"
chmod -R u+w "$dest/crd" "$dest/webhook"  # the module cache is read-only

export CGO_ENABLED=0
ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version"
GOBIN=$dest/bin.tmp go install -trimpath -ldflags "$ldflags" "sigs.k8s.io/kueue/cmd/kueue@$version" >&2
mv "$dest/bin.tmp/kueue" "$dest/bin/kueue"
rmdir "$dest/bin.tmp"
"$dest/bin/kueue" --help >/dev/null 2>&1 || { echo "provision/kueue.sh: the built kueue does not run" >&2; exit 1; }
echo "provision/kueue.sh: built kueue $version in $(( $(date +%s) - started )) s" >&2
touch "$dest/.complete"
echo "$dest"
