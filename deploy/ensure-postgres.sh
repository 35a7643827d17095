#!/bin/sh
# Make sure PostgreSQL answers on 127.0.0.1:5432 and holds the test role and
# database the tests use: install it with apt-get when it is missing, start
# its cluster when it is stopped (or create one), wait until it answers, then
# create the role and the database (idempotent; safe to run again).
#
# The test role logs in with a password over TCP (scram on a stock Debian
# cluster, trust on a machine that trusts loopback): role octo_test,
# password octo-test, database octo_test, owned by the role. Tests create a
# schema of their own in it and drop it afterwards. The password is a
# public test value, never a production one.
set -eu

ROLE=octo_test
PASSWORD=octo-test
DATABASE=octo_test
PORT=${OCTO_TEST_PG_PORT:-5432}  # another port only to try this script on a spare cluster

answers() {
    python3 - "$PORT" <<'PY'
import socket, sys
s = socket.socket()
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
s.close()
PY
}

# psql as the cluster's superuser: over the socket as the postgres system user
# when we are root (peer or trust), else over TCP as the postgres role.
as_superuser() {
    if [ "$(id -u)" = 0 ] && id postgres >/dev/null 2>&1; then
        (cd / && runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$PORT" "$@")
    else
        psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres "$@"
    fi
}

test_role_logs_in() {
    command -v psql >/dev/null 2>&1 || return 1
    PGPASSWORD="$PASSWORD" PGCONNECT_TIMEOUT=3 psql -X -q -w -h 127.0.0.1 -p "$PORT" \
        -U "$ROLE" -d "$DATABASE" -c 'SELECT 1' >/dev/null 2>&1
}

start_clusters() {
    # Each line: version cluster port status owner data-directory log-file.
    pg_lsclusters --no-header | while read -r version cluster port status _rest; do
        if [ "$port" = "$PORT" ] && [ "${status%%,*}" != online ]; then
            echo "ensure-postgres: starting cluster $version/$cluster" >&2
            pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" start || true
        fi
    done
}

if answers && test_role_logs_in; then
    exit 0
fi

if ! answers; then
    if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
        echo "ensure-postgres: installing postgresql with apt-get" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q postgresql
    fi
    if [ -z "$(pg_lsclusters --no-header 2>/dev/null)" ]; then
        version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
        echo "ensure-postgres: creating cluster $version/main" >&2
        pg_createcluster "$version" main --port "$PORT" >/dev/null
    fi
    start_clusters
fi

i=0
while ! answers; do
    i=$((i + 1))
    if [ "$i" -gt 60 ]; then
        echo "ensure-postgres: PostgreSQL does not answer on 127.0.0.1:$PORT" >&2
        exit 1
    fi
    sleep 1
done

echo "ensure-postgres: creating role $ROLE and database $DATABASE" >&2
as_superuser -d postgres -v role="$ROLE" -v password="$PASSWORD" -v database="$DATABASE" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \gexec
SELECT format('ALTER ROLE %I LOGIN PASSWORD %L', :'role', :'password') \gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'database', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'database') \gexec
SQL

if ! test_role_logs_in; then
    echo "ensure-postgres: role $ROLE cannot log in to $DATABASE on 127.0.0.1:$PORT" \
        "(check pg_hba.conf: host connections need scram-sha-256, md5 or trust)" >&2
    exit 1
fi
