#!/usr/bin/env bash
# Start and stop docker/compose.yaml with the engine .ci/engine.sh finds (or installs): `make stack-up`,
# `make stack-down`.
#
#   docker/stack.sh up [COMPOSE-FILE...]   start (extra files override compose.yaml); return when every service
#                                         is healthy (the one-shot `model` service: exited 0)
#   docker/stack.sh down [--volumes]       stop and remove the containers (and with --volumes the data)
#   docker/stack.sh ps | logs SERVICE...   what the compose tool says
#
# The images are those `make images` recorded in docker/.images.env. The keys come from the environment
# (docker/README.md); any of them unset is generated once, a throwaway for trying the stack, and kept in
# docker/.stack-keys.env (mode 600) so that the next `up` finds the same PostgreSQL password.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "stack.sh: $(date -u +%T) $*" >&2; }
eval "$(.ci/engine.sh)"
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-tracetrain}
[ -f docker/.images.env ] && set -a && . docker/.images.env && set +a
run_dir=/run/tracetrain-stack/$COMPOSE_PROJECT_NAME
mkdir -p "$run_dir"

keys() {
    local file=docker/.stack-keys.env name
    [ -f "$file" ] && set -a && . "$file" && set +a
    for name in POSTGRES_PASSWORD TRACETRAIN_API_KEYS TRACETRAIN_REWARD_KEYS TRACETRAIN_ADMIN_TOKEN \
                TRACETRAIN_ADAPTERS_KEY; do
        [ -n "${!name:-}" ] && continue
        log "$name unset: a throwaway key generated into $file"
        (umask 077; echo "$name=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')" >>"$file")
    done
    [ -f "$file" ] && set -a && . "$file" && set +a
    return 0
}

# Podman schedules health checks with systemd timers; where there is no systemd (a container, a bare VM) a
# loop here runs each container's check at its own interval, for as long as the stack runs.
health_loop() {
    declare -A last
    while true; do
        for id in $(podman ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"); do
            status=$(podman inspect --format '{{if .Config.Healthcheck}}{{.State.Health.Status}}{{end}}' "$id" \
                2>/dev/null) || continue
            [ -z "$status" ] && continue
            # Until a container is healthy its check runs every 2 s (what `up` waits on), then every 15 s.
            every=2
            [ "$status" = healthy ] && every=15
            if [ $((SECONDS - ${last[$id]:-0})) -ge "$every" ]; then
                last[$id]=$SECONDS
                podman healthcheck run "$id" >/dev/null 2>&1 || true
            fi
        done
        sleep 1
    done
}

start_health_loop() {
    [ "$ENGINE" = podman ] || return 0
    [ -f "$run_dir/health.pid" ] && kill -0 "$(cat "$run_dir/health.pid")" 2>/dev/null && return 0
    export -f health_loop
    export COMPOSE_PROJECT_NAME CONTAINERS_CONF
    setsid bash -c health_loop >>"$run_dir/health.log" 2>&1 </dev/null &
    echo $! >"$run_dir/health.pid"
}

stop_health_loop() {
    [ -f "$run_dir/health.pid" ] || return 0
    kill -- "-$(cat "$run_dir/health.pid")" 2>/dev/null || true
    rm -f "$run_dir/health.pid"
}

files=(-f docker/compose.yaml)
case "${1:-}" in
up)
    shift
    for extra in "$@"; do files+=(-f "$extra"); done
    printf '%s\n' "${files[@]}" >"$run_dir/files"
    keys
    start=$SECONDS
    start_health_loop
    running=$($ENGINE ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
    if [ -n "$running" ]; then
        # docker-compose 1.29 reads the network podman made as changed (its IPAM driver) and refuses a second `up`:
        # a stack already there is only waited for (stack-down first to start it with other files or settings).
        log "$COMPOSE_PROJECT_NAME is up already: waiting for its services' health"
    else
        # A network left by an `up` that stopped half-way: the same refusal, so it goes first.
        $ENGINE network rm "${COMPOSE_PROJECT_NAME}_default" >/dev/null 2>&1 || true
        $COMPOSE "${files[@]}" up -d --no-build
    fi
    # `up -d` waits for the health of what others depend on; the rest (lb, the trainer) is waited for here.
    services=$($COMPOSE "${files[@]}" config --services)
    while true; do
        waiting=()
        for service in $services; do
            id=$($COMPOSE "${files[@]}" ps -q "$service" 2>/dev/null | head -n 1)
            [ -z "$id" ] && waiting+=("$service(none)") && continue
            state=$($ENGINE inspect --format \
                '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}} {{.State.ExitCode}}' "$id")
            case "$state" in
            "running healthy"*) ;;
            exited*" 0") [ "$service" = model ] || waiting+=("$service(exited)") ;;
            exited*) log "$service exited: $state"; $COMPOSE "${files[@]}" logs --tail 30 "$service" >&2; exit 1 ;;
            *) waiting+=("$service(${state% *})") ;;
            esac
        done
        [ ${#waiting[@]} -eq 0 ] && break
        start_health_loop  # again, should it have died: what `up` waits for would never change
        [ $((SECONDS - start)) -gt "${STACK_UP_TIMEOUT_S:-1500}" ] && log "not healthy: ${waiting[*]}" && exit 1
        sleep 5
    done
    log "every service healthy after $((SECONDS - start)) s; the entry point is http://127.0.0.1:${TRACETRAIN_PORT:-8100}"
    ;;
down)
    shift
    [ -f "$run_dir/files" ] && mapfile -t files <"$run_dir/files"
    keys >/dev/null 2>&1
    $COMPOSE "${files[@]}" down "$@"
    stop_health_loop
    [ "${1:-}" = --volumes ] && rm -f docker/.stack-keys.env
    left=$($ENGINE ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
    [ -z "$left" ] || { log "still running: $left"; exit 1; }
    log "stopped; no container of $COMPOSE_PROJECT_NAME runs"
    ;;
ps | logs)
    [ -f "$run_dir/files" ] && mapfile -t files <"$run_dir/files"
    keys >/dev/null 2>&1
    $COMPOSE "${files[@]}" "$@"
    ;;
*)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
