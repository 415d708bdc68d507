#!/usr/bin/env bash
# The deployment, run for real on a host without a registry or a bridge network (docs/deploy.md):
#   1. the local base images and the wheelhouse (scripts/deploy_base.sh; cached), the images built by compose
#      (SPECDEC_MODELS=mount: the models are mounted from SPECDEC_MODELS_DIR, default ~/.cache/specdec, prepared
#      with `specdec models prepare`), their sizes;
#   2. `compose up` with host networking (deploy/compose.host.yml): Redis, two verifier replicas, nginx; the time
#      until the replicas' gRPC health checks pass and the balancer answers;
#   3. generations through the balancer (the edge image), one with the replica serving it SIGKILLed mid-run, all
#      token-identical to `specdec generate --target-only` (scripts/deploy_generate.py);
#   4. `compose down`, then nothing of the project left (containers, networks, volumes);
#   5. the same with the profile "sentinel", the Redis master container SIGKILLed mid-generation.
# Exit status 0 when every check holds. Needs: docker (and `docker compose` or docker-compose), root for
# debootstrap on the first run. Usage: scripts/deploy_check.sh   (SPECDEC_DEPLOY_SKIP_SENTINEL=1 skips step 5)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${SPECDEC_DEPLOY_CACHE:-/var/tmp/specdec-deploy}"
PROJECT=specdec-deploy-check
PY="${PYTHON:-python3}"
if ! docker info >/dev/null 2>&1; then echo "error: docker does not answer (is dockerd running?)" >&2; exit 2; fi
if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=docker-compose
else echo "error: neither \`docker compose\` nor docker-compose found" >&2; exit 2; fi

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

scripts/deploy_base.sh
export SPECDEC_BASE_IMAGE=specdec-local/base:bookworm SPECDEC_BUILDER_IMAGE=specdec-local/builder:bookworm \
  SPECDEC_REDIS_IMAGE=specdec-local/services:bookworm SPECDEC_NGINX_IMAGE=specdec-local/services:bookworm \
  SPECDEC_MODELS=mount

# the mounted models must be readable by the containers' user (uid 10001): else a readable copy, once
models="${SPECDEC_MODELS_DIR:-$HOME/.cache/specdec}"
for m in smollm2-135m-instruct smollm2-135m-instruct-onnx-int8; do
  [ -f "$models/$m/.specdec-complete" ] || { echo "error: $models/$m is not prepared (specdec models prepare)" >&2; exit 2; }
done
if [ -n "$(find "$models" ! -perm -o=r -print -quit)" ]; then
  mkdir -p "$CACHE/models"
  cp -r -u "$models/." "$CACHE/models/" && chmod -R a+rX "$CACHE/models"
  models="$CACHE/models"
fi
export SPECDEC_MODELS_DIR="$models"

FILES=(-f docker-compose.yml -f deploy/compose.host.yml -f deploy/compose.models.yml)
SENTINEL_FILES=("${FILES[@]}" -f deploy/compose.sentinel.yml -f deploy/compose.host-sentinel.yml --profile sentinel)
compose() { $COMPOSE -p "$PROJECT" "$@"; }
down() { compose "${SENTINEL_FILES[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true; }
trap down EXIT
down   # a previous run's leftovers

for port in 50060 50061 50062 19090 19091 16379 16380 16381 16382 26380 26381 26382; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "error: 127.0.0.1:$port is taken (deploy/compose.host.yml listens there)" >&2; exit 2
  fi
done

t=$(now)
compose "${FILES[@]}" build --quiet verifier edge-demo 2>&1 | { grep -v -e DEPRECATED -e buildx -e "^ *$" || true; }
echo "== images built in $(since "$t") s"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^specdec-(verifier|edge|local/)' | sort
if docker run --rm specdec-edge:latest python -c 'import torch' 2>/dev/null; then
  echo "error: the edge image contains torch" >&2; exit 1
fi

healthy() {   # the replicas' health checks pass (Docker's health state) and the balancer answers gRPC health
  local t0="$1" deadline=$((SECONDS + 300))
  shift
  compose "$@" up -d balancer
  until compose "$@" run --rm --no-deps -T edge-demo python -m specdec_runtime.cloud_verifier.serving.healthcheck \
      --address 127.0.0.1:50060 --timeout 2 >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { echo "error: the balancer is not serving after 300 s" >&2; compose "$@" logs --tail 30; exit 1; }
    sleep 1
  done
  for c in $(compose "$@" ps -q verifier verifier-b); do
    [ "$(docker inspect -f '{{.State.Health.Status}}' "$c")" = healthy ] || { echo "error: $c not healthy" >&2; exit 1; }
  done
  echo "== healthy (both replicas, and the balancer answers gRPC health) $(since "$t0") s after \`compose up\`"
}

left_behind() {
  local n
  n=$( (docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"
        docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"
        docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT") | wc -l)
  echo "== compose down: $n containers, networks or volumes of $PROJECT left"
  [ "$n" -eq 0 ]
}

ref="$(mktemp /tmp/specdec-deploy-ref.XXXXXX.json)"
gen() { $PY scripts/deploy_generate.py "$1" --reference "$ref" --compose "$COMPOSE -p $PROJECT ${*:2}"; }
status=0

healthy "$(now)" "${FILES[@]}"
gen reference "${FILES[@]}"
gen replica-failover "${FILES[@]}" || status=1
echo "== scale back to two replicas (the killed one restarted by \`compose up\`)"
healthy "$(now)" "${FILES[@]}"
compose "${FILES[@]}" down --volumes --remove-orphans
left_behind || status=1

if [ "${SPECDEC_DEPLOY_SKIP_SENTINEL:-0}" != 1 ]; then
  healthy "$(now)" "${SENTINEL_FILES[@]}"
  gen store-failover "${SENTINEL_FILES[@]}" || status=1
  compose "${SENTINEL_FILES[@]}" down --volumes --remove-orphans
  left_behind || status=1
fi
rm -f "$ref"
trap - EXIT
[ "$status" -eq 0 ] && echo "== deploy check passed" || echo "== deploy check FAILED"
exit "$status"
