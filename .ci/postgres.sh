#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on loopback for the sweep storage tests (tests/test_sweeps.py).
#
#   .ci/postgres.sh start   install the Debian package if missing, start a server on 127.0.0.1:$PORT and
#                           print its URL on stdout (nothing else); exit 1 when that is impossible
#   .ci/postgres.sh stop    stop it
#
# The server runs as the `postgres` user from its own data folder (not the system cluster), with
# password authentication for one user, d3d, that owns one database, d3d. Diagnostics go to stderr.
set -uo pipefail
PORT="${D3D_PG_PORT:-54329}"
DATA="${TMPDIR:-/tmp}/d3d-prune-pg-$PORT"
URL="postgresql://d3d:d3d@127.0.0.1:$PORT/d3d"

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
as_postgres() { if [ "$(id -un)" = postgres ]; then "$@"; else runuser -u postgres -- "$@"; fi; }

start() {
    if [ -z "$(pg_bin)" ]; then
        if [ "$(id -u)" != 0 ]; then echo "postgres.sh: PostgreSQL is not installed and we are not root" >&2; return 1; fi
        echo "postgres.sh: installing the postgresql package" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq postgresql >&2 || { apt-get update -qq >&2 && apt-get install -y -qq postgresql >&2; } \
            || { echo "postgres.sh: apt-get could not install postgresql" >&2; return 1; }
    fi
    local bin; bin="$(pg_bin)"
    id postgres >/dev/null 2>&1 || { echo "postgres.sh: no postgres user" >&2; return 1; }
    if ! "$bin/pg_isready" -q -h 127.0.0.1 -p "$PORT"; then
        if [ ! -f "$DATA/PG_VERSION" ]; then
            rm -rf "$DATA" && mkdir -p "$DATA" && chown postgres: "$DATA" && chmod 700 "$DATA" || return 1
            local pw; pw="$(mktemp)"; echo d3d > "$pw"; chmod 644 "$pw"
            as_postgres "$bin/initdb" -D "$DATA" -U d3d --pwfile="$pw" -A scram-sha-256 -E UTF8 >"$DATA.initdb.log" 2>&1
            local rc=$?; rm -f "$pw"; [ $rc = 0 ] || { echo "postgres.sh: initdb failed" >&2; return 1; }
        fi
        as_postgres "$bin/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w -t 60 \
            -o "-p $PORT -c listen_addresses=127.0.0.1 -k $DATA" start >&2 \
            || { echo "postgres.sh: the server did not start; see $DATA/server.log" >&2; tail -n 20 "$DATA/server.log" >&2; return 1; }
    fi
    PGPASSWORD=d3d "$bin/psql" -h 127.0.0.1 -p "$PORT" -U d3d -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'd3d'" | grep -q 1 \
        || PGPASSWORD=d3d "$bin/createdb" -h 127.0.0.1 -p "$PORT" -U d3d d3d >&2 \
        || { echo "postgres.sh: could not create the database" >&2; return 1; }
    echo "$URL"
}

stop() {
    local bin; bin="$(pg_bin)"
    [ -n "$bin" ] && [ -f "$DATA/postmaster.pid" ] && as_postgres "$bin/pg_ctl" -D "$DATA" -m fast -w stop >&2
    return 0
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
