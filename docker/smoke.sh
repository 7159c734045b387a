#!/usr/bin/env bash
# docker/smoke.sh: build the CPU image and run specdec from it on one machine, as
# docker/compose.yaml does: a tiny random model pair written into a volume, draft, target, Redis
# and the coordinator as containers on one network, the coordinator's gRPC and HTTP ports
# published on 127.0.0.1. Then it generates through both ports from outside the containers,
# checks that the session reached Redis, prints the images' sizes and the build time, and
# removes every container, network and volume it made. No download of models; with the default
# bases no image registry either (docker/base-image.sh makes them from Debian's packages).
#
#   docker/smoke.sh
#
# Environment (all optional):
#   SPECDEC_ENGINE        docker or podman (default: the first whose `info` answers)
#   SPECDEC_IMAGE         the image to build (specdec:0.1.0)
#   SPECDEC_PYTHON_IMAGE  the Dockerfile's PYTHON_IMAGE (localhost/specdec-base-python:bookworm,
#                         made by docker/base-image.sh when missing); python:3.12.12-slim-bookworm
#                         builds on the official image where a registry is reachable
#   SPECDEC_REDIS_IMAGE   the session store (localhost/specdec-redis:bookworm, made when missing)
#   SPECDEC_WHEEL_DIRS    folders searched for a torch CPU wheel to build with (default
#                         $PIP_FIND_LINKS); when one is found it is linked into docker/wheels/ and
#                         torch's dependencies come from SPECDEC_TORCH_INDEX_URL ($PIP_INDEX_URL,
#                         else PyPI) instead of the torch CPU index
#   SPECDEC_RUN_FLAGS     extra `run` flags for this engine (default: the first set that runs a
#                         container here, see probe_run_flags)
#   SPECDEC_PYTHON        a Python with specdec's dependencies, for the gRPC client (python3)
#
# Exit status: 0 everything worked; 1 a step failed (its containers' logs are printed);
# 2 it cannot start (no container engine, no mmdebstrap for a missing base, no Python for the
# client); 3 the images were built but this engine cannot run containers here (the engine's
# error is printed).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${SPECDEC_IMAGE:-specdec:0.1.0}
PYTHON_IMAGE=${SPECDEC_PYTHON_IMAGE:-localhost/specdec-base-python:bookworm}
REDIS_IMAGE=${SPECDEC_REDIS_IMAGE:-localhost/specdec-redis:bookworm}
PYTHON=${SPECDEC_PYTHON:-python3}
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' "$ROOT/docker/Dockerfile")
PROJECT=specdec-smoke-$$
HEALTH_TIMEOUT_S=300
PROMPT="def fibonacci(n):"

log() { printf '[smoke %s] %s\n' "$(date +%T)" "$*" >&2; }
stop() { log "$2"; exit "$1"; }

pick_engine() {
  local candidate
  if [[ -n "${SPECDEC_ENGINE:-}" ]]; then echo "$SPECDEC_ENGINE"; return; fi
  for candidate in docker podman; do
    if command -v "$candidate" >/dev/null && timeout 20 "$candidate" info >/dev/null 2>&1; then
      echo "$candidate"; return
    fi
  done
  stop 2 "no container engine answers here (docker info, podman info): install docker.io or podman"
}

ENGINE=$(pick_engine)
engine() { "$ENGINE" "$@"; }
have_image() { engine image inspect "$1" >/dev/null 2>&1; }
# the gRPC client runs here, outside the containers, from this checkout
client() { PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$@"; }
client -c "import grpc, specdec_cli" 2>/dev/null \
  || stop 2 "$PYTHON cannot import specdec_cli: set SPECDEC_PYTHON to a Python with specdec's dependencies"

# ---- bases ---------------------------------------------------------------------------------------
made_base() {  # $1 flavour, $2 image: make a default local base that is missing
  if have_image "$2"; then return; fi
  [[ "$2" == localhost/specdec-* ]] || return 0  # another base: the build pulls it
  command -v mmdebstrap >/dev/null || stop 2 "$2 is missing and mmdebstrap is not installed"
  local start=$SECONDS
  log "making $2 from Debian's packages (docker/base-image.sh $1)"
  SPECDEC_ENGINE=$ENGINE "$ROOT/docker/base-image.sh" "$1" "$2" >/dev/null
  log "made $2 in $((SECONDS - start)) s"
}
made_base python "$PYTHON_IMAGE"
made_base redis "$REDIS_IMAGE"

# ---- which run flags start a container here --------------------------------------------------
# Some sandboxes refuse what an engine does by default: crun cannot run under cgroups v1+v2
# "hybrid" mounts (runc can), and without CAP_SYS_RESOURCE the rootful default limits (1048576
# open files and processes) cannot be set (the machine's own hard limits can; podman's conmon
# runs with at most 32768 processes).
probe_run_flags() {
  local files procs candidate
  files=$(ulimit -Hn); procs=$(ulimit -Hu)
  [[ "$files" == unlimited ]] && files=1048576
  [[ "$procs" == unlimited || "$procs" -gt 32768 ]] && procs=32768
  local limits="--ulimit nofile=$files:$files --ulimit nproc=$procs:$procs"
  for candidate in "" "$limits" "--runtime runc" "--runtime runc $limits"; do
    # shellcheck disable=SC2086  # candidate is a list of flags
    if PROBE_ERROR=$(engine run --rm $candidate "$PYTHON_IMAGE" true 2>&1); then
      RUN_FLAGS=$candidate; return 0
    fi
    [[ -n "${FIRST_ERROR:-}" ]] || FIRST_ERROR=$PROBE_ERROR
  done
  return 1
}
RUN_OK=1
if [[ -n "${SPECDEC_RUN_FLAGS+set}" ]]; then
  RUN_FLAGS=$SPECDEC_RUN_FLAGS
elif probe_run_flags; then
  [[ -z "$RUN_FLAGS" ]] || log "the default run failed here ($FIRST_ERROR); using: $RUN_FLAGS"
else
  RUN_OK=0; RUN_FLAGS=""
fi
# a build's RUN steps go through the same runtime
BUILD_FLAGS=()
if [[ "$ENGINE" == podman ]]; then
  BUILD_FLAGS+=(--format docker)  # keeps HEALTHCHECK (OCI images have none)
  if [[ "$RUN_FLAGS" =~ --runtime\ ([a-z]+) ]]; then BUILD_FLAGS+=(--runtime "${BASH_REMATCH[1]}");
  elif (( ! RUN_OK )); then BUILD_FLAGS+=(--isolation chroot); fi
fi

# ---- build --------------------------------------------------------------------------------------
BUILD_ARGS=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
for dir in ${SPECDEC_WHEEL_DIRS:-${PIP_FIND_LINKS:-}}; do
  for wheel in "$dir"/torch-"$TORCH_VERSION"+cpu-*.whl; do
    [[ -f "$wheel" ]] || continue
    target=$ROOT/docker/wheels/$(basename "$wheel")
    [[ "$wheel" -ef "$target" ]] || ln -f "$wheel" "$target" 2>/dev/null || cp "$wheel" "$target"
    log "torch from $wheel"
  done
done
if compgen -G "$ROOT/docker/wheels/torch-*.whl" >/dev/null; then
  BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=${SPECDEC_TORCH_INDEX_URL:-${PIP_INDEX_URL:-https://pypi.org/simple}}")
fi
log "building $IMAGE with $ENGINE ${BUILD_FLAGS[*]} ${BUILD_ARGS[*]}"
start=$SECONDS
engine build "${BUILD_FLAGS[@]}" "${BUILD_ARGS[@]}" -f "$ROOT/docker/Dockerfile" -t "$IMAGE" "$ROOT" >&2 \
  || stop 1 "FAILED: the build of $IMAGE"
BUILD_S=$((SECONDS - start))
log "built $IMAGE in $BUILD_S s (layers found in the engine's cache are not rebuilt)"
size_mb() { engine image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }
sizes() {
  local image
  for image in "$IMAGE" "$PYTHON_IMAGE" "$REDIS_IMAGE"; do
    have_image "$image" && log "size of $image: $(size_mb "$image")"
  done
}
if (( ! RUN_OK )); then
  sizes
  stop 3 "$ENGINE cannot run a container here; the images are built. Its error: $FIRST_ERROR"
fi

# ---- run ----------------------------------------------------------------------------------------
CONTAINERS=()
teardown() {
  local status=$? name
  if (( status != 0 )); then
    for name in "${CONTAINERS[@]}"; do
      log "--- logs of $name"; engine logs --tail 40 "$name" >&2 2>&1 || true
    done
  fi
  if (( ${#CONTAINERS[@]} )); then
    engine stop -t 5 "${CONTAINERS[@]}" >/dev/null 2>&1 || true
    engine rm -f "${CONTAINERS[@]}" >/dev/null 2>&1 || true
  fi
  engine network rm "$PROJECT" >/dev/null 2>&1 || true
  engine volume rm "$PROJECT-models" "$PROJECT-cache" >/dev/null 2>&1 || true
}
trap teardown EXIT
# as docker/compose.yaml runs them: read-only root, /tmp in memory, no capabilities
# shellcheck disable=SC2206  # RUN_FLAGS is a list of flags
COMMON=(--network "$PROJECT" --read-only --tmpfs /tmp --security-opt no-new-privileges --cap-drop ALL $RUN_FLAGS)
VOLUMES=(-v "$PROJECT-models:/models:ro" -v "$PROJECT-cache:/cache")
engine network create "$PROJECT" >/dev/null
engine volume create "$PROJECT-models" >/dev/null
engine volume create "$PROJECT-cache" >/dev/null

start_container() {  # $1 name (also its name on the network), then run arguments
  local name=$1; shift
  CONTAINERS+=("$PROJECT-$name")
  engine run -d --name "$PROJECT-$name" --network-alias "$name" "${COMMON[@]}" "$@" >/dev/null
}
wait_healthy() {  # $1 name, then the check to run in it
  local name=$PROJECT-$1 deadline=$((SECONDS + HEALTH_TIMEOUT_S)); shift
  until engine exec "$name" "$@" >/dev/null 2>&1; do
    [[ "$(engine inspect --format '{{.State.Running}}' "$name")" == true ]] || stop 1 "FAILED: $name exited"
    (( SECONDS < deadline )) || stop 1 "FAILED: $name not healthy after $HEALTH_TIMEOUT_S s"
    sleep 1
  done
  log "$name is healthy"
}

log "writing the tiny model pair into volume $PROJECT-models"
engine run --rm "${COMMON[@]}" -v "$PROJECT-models:/models" -v "$PROJECT-cache:/cache" "$IMAGE" \
  models tiny /models/tiny >&2 || stop 1 "FAILED: specdec models tiny"
start_container redis "$REDIS_IMAGE"
for tier in draft target; do
  port=$([[ $tier == draft ]] && echo 50052 || echo 50053)
  start_container "$tier" "${VOLUMES[@]}" -e "SPECDEC_${tier^^}_MODEL=/models/tiny/$tier" \
    -e "SPECDEC_${tier^^}_DTYPE=bfloat16" "$IMAGE" serve "$tier" --host 0.0.0.0 --port "$port" --metrics-port 9090
done
wait_healthy redis redis-cli ping
wait_healthy draft specdec-healthcheck
wait_healthy target specdec-healthcheck
start_container coordinator "${VOLUMES[@]}" -p 127.0.0.1::50051 -p 127.0.0.1::8000 -p 127.0.0.1::9090 "$IMAGE" \
  serve coordinator --host 0.0.0.0 --port 50051 --draft draft:50052 --target target:50053 \
  --session-store redis://redis:6379/0 --metrics-port 9090 --http-port 8000
wait_healthy coordinator specdec-healthcheck
published() { engine port "$PROJECT-coordinator" "$1/tcp" | head -n 1 | sed 's/^0\.0\.0\.0:/127.0.0.1:/'; }
GRPC=$(published 50051); HTTP=$(published 8000); METRICS=$(published 9090)
log "coordinator published on gRPC $GRPC, HTTP $HTTP, metrics $METRICS"

# ---- generate from outside ----------------------------------------------------------------------
field() {  # a field of the JSON on stdin, by its keys and indices: field stats generated_tokens
  "$PYTHON" -c 'import json, sys
value = json.load(sys.stdin)
for key in sys.argv[1:]:
    value = value[int(key)] if key.isdigit() else value[key]
print(json.dumps(value) if isinstance(value, (dict, list)) else value)' "$@"
}
first=$(client -m specdec_cli generate --address "$GRPC" --max-new-tokens 16 --temperature 0 --json "$PROMPT") \
  || stop 1 "FAILED: gRPC Generate through $GRPC"
session=$(field session_id <<<"$first")
generated=$(field stats generated_tokens <<<"$first")
(( generated > 0 )) || stop 1 "FAILED: gRPC Generate returned no token: $first"
log "gRPC Generate: $generated tokens, session $session, stats $(field stats <<<"$first")"
more=$(client -m specdec_cli generate --address "$GRPC" --max-new-tokens 8 --temperature 0 --json \
  --session "$session" $'\n# tests\n') || stop 1 "FAILED: gRPC Generate continuing session $session"
log "gRPC Generate continued session $session: $(field stats generated_tokens <<<"$more") tokens"
stored=$(engine exec "$PROJECT-redis" redis-cli --scan --pattern "*$session*" | grep -c . || true)
(( stored > 0 )) || stop 1 "FAILED: no Redis key names session $session"
log "Redis holds $stored key(s) of session $session"

models=$(curl -sSf "http://$HTTP/v1/models") || stop 1 "FAILED: GET /v1/models on $HTTP"
model=$(field data 0 id <<<"$models")
completion=$(curl -sSf "http://$HTTP/v1/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"$PROMPT\", \"max_tokens\": 16, \"temperature\": 0}") \
  || stop 1 "FAILED: POST /v1/completions on $HTTP"
tokens=$(field usage completion_tokens <<<"$completion")
(( tokens > 0 )) || stop 1 "FAILED: the HTTP completion has no token: $completion"
log "HTTP /v1/completions (model $model): $tokens tokens, finish $(field choices 0 finish_reason <<<"$completion")"
metrics=$(curl -sSf "http://$METRICS/metrics") || stop 1 "FAILED: GET /metrics on $METRICS"
grep -q '^specdec_' <<<"$metrics" || stop 1 "FAILED: no specdec_ metric on $METRICS"
log "coordinator metrics on $METRICS: ok"

sizes
log "engine: $ENGINE $(engine --version | head -n 1)${RUN_FLAGS:+ (run flags: $RUN_FLAGS)}"
log "PASSED"
