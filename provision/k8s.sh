#!/usr/bin/env bash
# Builds a Kubernetes control plane once per machine from the Go module proxy and prints the
# directory holding the binaries: kube-apiserver, kube-scheduler, kube-controller-manager
# (k8s.io/kubernetes) and etcd (go.etcd.io/etcd/server/v3, the version that Kubernetes release pins).
#
# `go install k8s.io/kubernetes/cmd/...@vX` does not work: k8s.io/kubernetes's go.mod replaces its
# staging modules (k8s.io/api, k8s.io/apiserver, ...) with local paths. So this script writes a
# throw-away wrapper module that requires k8s.io/kubernetes and replaces every staging module with
# its published v0.MINOR.PATCH tag, the list taken from the release's own go.mod.
#
# Cache: ${GPUSLO_CACHE:-~/.cache/gpuslo}/k8s-VERSION/bin (reused when .complete is there and
# every binary below is in it). A cache made before a binary joined the list keeps its binaries:
# only the missing ones are built, each to a temporary name moved into place when it is whole.
set -euo pipefail
version=${GPUSLO_K8S_VERSION:-v1.34.4}
cache=${GPUSLO_CACHE:-$HOME/.cache/gpuslo}
dest=$cache/k8s-$version
binaries=(kube-apiserver kube-scheduler kube-controller-manager etcd)
missing=()
for b in "${binaries[@]}"; do
  [ -x "$dest/bin/$b" ] || missing+=("$b")
done
if [ -f "$dest/bin/.complete" ] && [ ${#missing[@]} -eq 0 ]; then
  echo "$dest/bin"
  exit 0
fi
# one build at a time (test runs in parallel); the one that waited builds only what is still missing
mkdir -p "$cache"
exec 9>"$cache/.k8s-$version.lock"
flock 9
missing=()
for b in "${binaries[@]}"; do
  [ -x "$dest/bin/$b" ] || missing+=("$b")
done
if [ -f "$dest/bin/.complete" ] && [ ${#missing[@]} -eq 0 ]; then
  echo "$dest/bin"
  exit 0
fi
if ! command -v go >/dev/null; then
  # Debian's Go may be older than the release needs; GOTOOLCHAIN=auto lets it fetch the Go
  # version the wrapper's go.mod names from the module proxy
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq golang-go >/dev/null
fi
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}

staging_version=v0.${version#v1.}
work=$dest/wrapper
if [ ! -f "$dest/bin/.complete" ]; then
  # no whole earlier build: nothing in bin/ is trusted
  rm -rf "$dest/bin"
  missing=("${binaries[@]}")
fi
rm -rf "$work"
mkdir -p "$work" "$dest/bin"
started=$(date +%s)

gomod=$(go mod download -json "k8s.io/kubernetes@$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$gomod" ] || { echo "provision/k8s.sh: could not download k8s.io/kubernetes@$version" >&2; exit 1; }
etcd_version=$(sed -n 's/^[[:space:]]*go.etcd.io\/etcd\/server\/v3 \(v[^ ]*\).*/\1/p' "$gomod" | head -1)
[ -n "$etcd_version" ] || { echo "provision/k8s.sh: no etcd server version in $gomod" >&2; exit 1; }

{
  echo "module gpuslo.invalid/k8s-build"
  echo
  echo "go 1.24.0"
  echo
  echo "require ("
  echo "	k8s.io/kubernetes $version"
  echo "	go.etcd.io/etcd/server/v3 $etcd_version"
  echo ")"
  echo
  echo "replace ("
  sed -n 's:^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*:\t\1 => \1 '"$staging_version"':p' "$gomod"
  echo ")"
} >"$work/go.mod"
n=$(grep -c " => " "$work/go.mod")
[ "$n" -gt 20 ] || { echo "provision/k8s.sh: only $n staging replacements found in $gomod" >&2; exit 1; }

# A file importing the commands' packages keeps `go mod tidy` from dropping what the build needs.
cat >"$work/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
)
EOF

cd "$work"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
go mod tidy >&2
minor=${version#v1.}
minor=${minor%%.*}
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
for b in "${missing[@]}"; do
  if [ "$b" = etcd ]; then
    go build -trimpath -ldflags "-s -w" -o "$dest/bin/etcd.tmp" go.etcd.io/etcd/server/v3 >&2
  else
    go build -trimpath -ldflags "$ldflags" -o "$dest/bin/$b.tmp" "k8s.io/kubernetes/cmd/$b" >&2
  fi
  mv "$dest/bin/$b.tmp" "$dest/bin/$b"
done
"$dest/bin/kube-apiserver" --version >&2
"$dest/bin/kube-controller-manager" --version >&2
"$dest/bin/etcd" --version >&2
echo "provision/k8s.sh: built ${missing[*]} ($version, etcd $etcd_version) in $(( $(date +%s) - started )) s" >&2
touch "$dest/bin/.complete"
echo "$dest/bin"
