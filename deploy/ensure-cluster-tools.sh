#!/bin/sh
# What make test-cluster needs besides the venv: the RabbitMQ server scripts
# (its nodes are its own; the shared broker is not started), ip and nft.
set -eu
missing=""
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing="$missing rabbitmq-server"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v nft >/dev/null 2>&1 || missing="$missing nftables"
if [ -n "$missing" ]; then
    echo "ensure-cluster-tools: installing$missing with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # shellcheck disable=SC2086
    apt-get install -y -q $missing
fi
