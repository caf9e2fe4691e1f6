#!/usr/bin/env bash
# `make stack-smoke` (after `make images`): docker/compose.yaml started with fresh volumes and the smoke's
# settings (docker/compose.smoke.yaml), docker/stack_smoke.py run against it, the stack stopped with its volumes
# removed, and nothing of it left running. Prints each part's time; on a failure, the services' last logs.
#
#   PY=.venv/bin/python .ci/stack-smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
eval "$(.ci/engine.sh)"
export ENGINE COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-tracetrain}
log() { echo "stack-smoke.sh: $*" >&2; }

docker/stack.sh down --volumes >/dev/null 2>&1 || true
smoke_log=$(mktemp)
on_exit() {
    rc=$?
    if [ $rc -ne 0 ]; then
        # Each service's last lines but the health checks' (which would fill the tail a CI log keeps), the
        # proxies and nginx last: they saw the failed call.
        for service in postgres model trainer vllm-a vllm-b lb proxy-b proxy-a; do
            log "failed; $service's last lines:"
            docker/stack.sh logs --no-color --tail 400 "$service" 2>&1 \
                | grep -v -E '"GET /(health|healthz|readyz|metrics|v1/models|nginx-health) HTTP' | tail -n 25 >&2 || true
        done
    fi
    start=$SECONDS
    docker/stack.sh down --volumes
    # Nothing of the stack left: docker/stack.sh checked its containers; its volumes and network go with them.
    left=$({ $ENGINE volume ls -q; $ENGINE network ls --format '{{.Name}}'; } | grep "^${COMPOSE_PROJECT_NAME}_" || true)
    if [ -n "$left" ]; then
        log "left after stack down: $left"
        [ $rc -eq 0 ] && rc=1
    else
        log "stack down, no container, volume or network of $COMPOSE_PROJECT_NAME left: $((SECONDS - start)) s"
    fi
    # What failed, again, as the last lines (the smoke's own account of the failed part).
    [ $rc -ne 0 ] && grep -E '^stack_smoke: (FAILED|.*failed|.*not within)' "$smoke_log" | tail -n 8 >&2
    rm -f "$smoke_log"
    exit $rc
}
trap on_exit EXIT

start=$SECONDS
docker/stack.sh up docker/compose.smoke.yaml
log "stack up (fresh volumes, every service healthy): $((SECONDS - start)) s"
set -a
. docker/.stack-keys.env 2>/dev/null || true
set +a
start=$SECONDS
"$PY" docker/stack_smoke.py 2>&1 | tee "$smoke_log"
log "smoke: $((SECONDS - start)) s"
