#!/usr/bin/env bash
# Fetches the Apache Kafka broker jars once per machine into ~/.cache/gpuslo/kafka-VERSION-POMHASH/libs
# (from Maven Central, with this directory's pom.xml) and prints that directory. The pom's hash
# is in the name: a change to it (a dependency added) fetches afresh, not the old jars.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")
pomhash=$(sha256sum "$here/kafka/pom.xml" | cut -c1-12)
dest=${GPUSLO_CACHE:-$HOME/.cache/gpuslo}/kafka-$version-$pomhash/libs
if [ ! -f "$dest/.complete" ]; then
  command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }
  command -v mvn >/dev/null || { apt-get update -qq && apt-get install -y -qq maven; }
  rm -rf "$dest" && mkdir -p "$dest"
  mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$dest" >&2
  touch "$dest/.complete"
fi
echo "$dest"
