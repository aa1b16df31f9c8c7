#!/usr/bin/env bash
# Fetches the Apache Kafka broker jars once per machine into ~/.cache/gpuslo/kafka-VERSION/libs
# (from Maven Central, with this directory's pom.xml) and prints that directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka/pom.xml")
dest=${GPUSLO_CACHE:-$HOME/.cache/gpuslo}/kafka-$version/libs
if [ ! -f "$dest/.complete" ]; then
  command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless; }
  command -v mvn >/dev/null || { apt-get update -qq && apt-get install -y -qq maven; }
  rm -rf "$dest" && mkdir -p "$dest"
  mvn -q -B -f "$here/kafka/pom.xml" dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$dest" >&2
  touch "$dest/.complete"
fi
echo "$dest"
