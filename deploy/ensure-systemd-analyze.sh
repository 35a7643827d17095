#!/bin/sh
# Make sure systemd-analyze is installed for the unit file's tests
# (`systemd-analyze verify`): install Debian's systemd package with apt-get
# when it is missing. Nothing is started or enabled by it here.
set -eu

if command -v systemd-analyze >/dev/null 2>&1; then
    exit 0
fi

echo "ensure-systemd-analyze: installing systemd (for systemd-analyze) with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends systemd
