#!/bin/sh
# The entry point of the PostgreSQL image built from Debian's packages (.ci/bases.sh): the contract of the
# official postgres image that docker/compose.yaml relies on. On an empty PGDATA it creates the cluster with
# POSTGRES_USER (password POSTGRES_PASSWORD, scram-sha-256 over TCP) and the database POSTGRES_DB, then runs
# the server in the foreground, listening on every address. It runs as the postgres user (the image's USER).
set -eu
: "${PGDATA:?}" "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        # Single-user mode: no server listens while the database is created.
        echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
fi
# The local socket in /tmp (PGHOST, for pg_isready): /run is the runtime's, not writable by postgres.
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp "$@"
