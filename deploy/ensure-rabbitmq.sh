#!/bin/sh
# Make sure a RabbitMQ broker answers on 127.0.0.1:5672: install it with
# apt-get when it is missing, start it when it is not running, then wait.
set -eu

answers() {
    python3 - <<'PY'
import socket, sys
s = socket.socket()
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", 5672))
except OSError:
    sys.exit(1)
s.close()
PY
}

if answers; then
    exit 0
fi

if ! command -v rabbitmq-server >/dev/null 2>&1; then
    echo "ensure-rabbitmq: installing rabbitmq-server with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q rabbitmq-server
fi

echo "ensure-rabbitmq: starting rabbitmq-server" >&2
rabbitmq-server -detached || true
rabbitmqctl await_startup --timeout 120 >/dev/null 2>&1 || rabbitmqctl wait --timeout 120 >/dev/null 2>&1 || true

i=0
while ! answers; do
    i=$((i + 1))
    if [ "$i" -gt 120 ]; then
        echo "ensure-rabbitmq: RabbitMQ does not answer on 127.0.0.1:5672" >&2
        exit 1
    fi
    sleep 1
done
