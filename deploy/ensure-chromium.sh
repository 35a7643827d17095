#!/bin/sh
# Make sure Debian's Chromium (and its driver) is installed for the console's
# browser tests: install both with apt-get when either is missing. Playwright
# drives /usr/bin/chromium; nothing downloads a browser build of its own.
set -eu

if [ -x /usr/bin/chromium ] && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi

echo "ensure-chromium: installing chromium and chromium-driver with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium chromium-driver
