#!/usr/bin/env bash
# A container engine and a compose tool for docker/compose.yaml, and the tools that build the local base images
# (.ci/bases.sh). Prints two lines, ENGINE=... and COMPOSE=..., for `eval`:
#
#   eval "$(.ci/engine.sh)"     # then: $ENGINE build ..., $COMPOSE -f docker/compose.yaml up -d
#
# A working Docker (`docker info` answers) is used as it is, with `docker compose` or docker-compose. Otherwise
# podman from Debian (installed with apt-get if missing), with runc and the settings of docker/engine/containers.conf
# (through CONTAINERS_CONF, so the machine's own configuration is not touched), and Debian's docker-compose 1.29
# talking to `podman system service` on a socket of its own. Needs root on Debian for the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "engine.sh: $*" >&2; }

apt_install() {
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# mmdebstrap builds the base images from Debian's packages where no registry is reachable.
apt_install mmdebstrap

sock_dir=/run/tracetrain-podman
sock=$sock_dir/podman.sock
# A Docker daemon of the machine's own; not the Docker API of the podman service below, which an earlier run of this
# script exported as DOCKER_HOST (docker/stack.sh under .ci/stack-smoke.sh runs it again).
if [ "${DOCKER_HOST:-}" != "unix://$sock" ] && docker info >/dev/null 2>&1; then
    if docker compose version >/dev/null 2>&1; then compose="docker compose"; else
        apt_install docker-compose
        compose="docker-compose"
    fi
    echo "ENGINE=docker"
    echo "COMPOSE='$compose'"
    exit 0
fi

apt_install podman runc netavark aardvark-dns uidmap docker-compose
conf=$PWD/docker/engine/containers.conf
export CONTAINERS_CONF=$conf
# Without systemd podman cannot schedule health checks on timers: docker/stack.sh runs them instead.
export DISABLE_HC_SYSTEMD=true
if ! curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
    mkdir -p "$sock_dir"
    log "starting podman system service on $sock"
    # setsid: the service outlives this script and the make that ran it (docker/stack.sh down leaves it up;
    # it holds nothing but the socket).
    setsid podman system service --time 0 "unix://$sock" >"$sock_dir/service.log" 2>&1 </dev/null &
    for _ in $(seq 50); do curl -sf --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break; sleep 0.2; done
    curl -sf --unix-socket "$sock" http://d/_ping >/dev/null || { log "podman system service did not answer"; exit 1; }
fi
echo "export CONTAINERS_CONF='$conf' DISABLE_HC_SYSTEMD=true DOCKER_HOST='unix://$sock'"
echo "ENGINE=podman"
echo "COMPOSE=docker-compose"
