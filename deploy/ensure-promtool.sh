#!/bin/sh
# Make sure promtool is at hand for the alert-rule tests: on the PATH, or in
# the directory given (the test environment's bin/). When it is neither,
# take it from Debian's `prometheus` package: downloaded with apt-get (no
# installation, so no Prometheus server is set up or started) and only
# promtool extracted into that directory.
#
#   sh deploy/ensure-promtool.sh .venv/bin
set -eu

target=${1:?usage: ensure-promtool.sh DIRECTORY}
if command -v promtool >/dev/null 2>&1 || [ -x "$target/promtool" ]; then
    exit 0
fi

echo "ensure-promtool: extracting promtool from Debian's prometheus package into $target" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1); then
    apt-get update -q
    (cd "$work" && apt-get download -q prometheus)
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
install -m 0755 "$work/root/usr/bin/promtool" "$target/promtool"
"$target/promtool" --version >/dev/null
