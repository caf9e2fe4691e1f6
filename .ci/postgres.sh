#!/usr/bin/env bash
# Start a local PostgreSQL for the tests that run the store on Postgres, and print the URL
# they read from TRACETRAIN_TEST_POSTGRES_URL. Needs root (apt-get) on a Debian machine.
set -euo pipefail
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
pg_lsclusters -h | grep -q "^$version main" || pg_createcluster "$version" main >/dev/null
pg_ctlcluster "$version" main start >/dev/null 2>&1 || true
for _ in $(seq 30); do su postgres -c "pg_isready -q" && break; sleep 1; done
su postgres -c "psql -q -tc \"SELECT 1 FROM pg_roles WHERE rolname='tracetrain'\" | grep -q 1 \
    || psql -q -c \"CREATE ROLE tracetrain LOGIN SUPERUSER PASSWORD 'tracetrain-ci-only-password'\""
su postgres -c "psql -q -tc \"SELECT 1 FROM pg_database WHERE datname='tracetrain_test'\" | grep -q 1 \
    || createdb -O tracetrain tracetrain_test"
echo "postgresql+asyncpg://tracetrain:tracetrain-ci-only-password@127.0.0.1:5432/tracetrain_test"
