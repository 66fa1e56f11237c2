#!/usr/bin/env bash
# The docker-compose deployment on one host, from a fresh Debian/Ubuntu machine (`make compose`).
#
#   bash scripts/compose.sh            # = all: engine, base, build, up, then where to look
#   bash scripts/compose.sh engine     # install the engine if missing (apt, as root), start dockerd
#   bash scripts/compose.sh base       # the base image, made locally with debootstrap (no registry)
#   bash scripts/compose.sh build      # the three images: roles, Kafka, Prometheus (BuildKit caches)
#   bash scripts/compose.sh build-registry  # the schema registry's image (needs a Java 21+ JDK here)
#   bash scripts/compose.sh up         # start the stack (profile cpu) and wait until it is healthy
#   bash scripts/compose.sh down [-v]  # stop it (-v: delete its volumes too)
#   bash scripts/compose.sh engine-stop  # stop dockerd, only if `engine` started it
#   bash scripts/compose.sh compose ARGS...  # any docker-compose command on this project
#
# Environment: AF_PROJECT (compose project name, astraflow), AF_RAAS (RaaS nodes, 2),
# AF_BASE_IMAGE (the base of every image; default: made here, astraflow/debian:bookworm),
# AF_DEBIAN_MIRROR (the mirror apt uses here), AF_TORCH_INDEX_URL (the CPU wheel index when it
# answers, else PyPI), AF_UP_TIMEOUT (seconds, 900), AF_REGISTRY=1 (the schema registry too: `build`
# builds its image, every compose command gets `--profile registry`, and the roles'
# AF_SCHEMA_REGISTRY_URL defaults to the service's), AF_PYTHON (the Python with astraflow that
# stages the registry image; default: the project's virtualenv, scripts/env.sh), and the compose
# variables that docker/docker-compose.yml lists (ports, experiment, model, workload).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PROJECT=${AF_PROJECT:-astraflow}
COMPOSE_FILE=$ROOT/docker/docker-compose.yml
LOCAL_BASE=astraflow/debian:bookworm
STATE=${ASTRAFLOW_HOME:-$HOME/.cache/astraflow}/compose
DOCKERD_MARK=/run/astraflow-dockerd.pid   # written only when this script started dockerd
export DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1
PROFILES=(--profile cpu)
if [ "${AF_REGISTRY:-0}" = 1 ]; then
  PROFILES+=(--profile registry)
  export AF_SCHEMA_REGISTRY_URL=${AF_SCHEMA_REGISTRY_URL:-http://registry:8080/apis/ccompat/v7}
fi

say() { echo "[compose] $*" >&2; }
die() { echo "[compose] error: $*" >&2; exit 1; }

# A docker client that builds with BuildKit: one with buildx, or a client older than 23 (BuildKit
# built in, e.g. Debian's docker.io). A newer client without buildx cannot build with BuildKit.
docker_client() {
  local c
  for c in docker /usr/bin/docker; do
    command -v "$c" > /dev/null 2>&1 || continue
    if "$c" buildx version > /dev/null 2>&1; then echo "$c"; return; fi
    local major
    major=$("$c" version --format '{{.Client.Version}}' 2> /dev/null | cut -d. -f1 || true)
    if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then echo "$c"; return; fi
  done
  return 1
}

compose_cmd() {
  if docker compose version > /dev/null 2>&1; then
    echo "docker compose"
  elif command -v docker-compose > /dev/null 2>&1; then
    echo docker-compose
  else
    return 1
  fi
}

engine() {
  local need=()
  command -v dockerd > /dev/null 2>&1 || need+=(docker.io)
  docker_client > /dev/null 2>&1 || need+=(docker.io)
  compose_cmd > /dev/null 2>&1 || need+=(docker-compose)
  command -v debootstrap > /dev/null 2>&1 || need+=(debootstrap)
  if [ "${#need[@]}" -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] && command -v apt-get > /dev/null 2>&1 ||
      die "missing ${need[*]}: install them (Debian: apt-get install -y docker.io docker-compose debootstrap)"
    say "installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q docker.io docker-compose debootstrap >&2
  fi
  local client
  client=$(docker_client) || die "no docker client that builds with BuildKit (install buildx, or Debian's docker.io)"
  if "$client" info > /dev/null 2>&1; then
    say "docker engine running"
    return
  fi
  [ "$(id -u)" -eq 0 ] || die "the docker engine is not running; start it (sudo systemctl start docker)"
  say "starting dockerd (log: /var/log/astraflow-dockerd.log)"
  setsid dockerd --pidfile /run/docker.pid > /var/log/astraflow-dockerd.log 2>&1 < /dev/null &
  echo $! > "$DOCKERD_MARK"
  for _ in $(seq 60); do
    "$client" info > /dev/null 2>&1 && { say "docker engine started (pid $(cat "$DOCKERD_MARK"))"; return; }
    sleep 1
  done
  tail -20 /var/log/astraflow-dockerd.log >&2
  die "dockerd did not answer within 60 s"
}

engine_stop() {
  [ -f "$DOCKERD_MARK" ] || { say "dockerd was not started by this script: left running"; return; }
  local pid
  pid=$(cat "$DOCKERD_MARK")
  if kill -0 "$pid" 2> /dev/null; then
    say "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
    kill -0 "$pid" 2> /dev/null && die "dockerd (pid $pid) still runs after 60 s"
  fi
  rm -f "$DOCKERD_MARK"
}

mirror() {
  if [ -n "${AF_DEBIAN_MIRROR:-}" ]; then echo "$AF_DEBIAN_MIRROR"; return; fi
  # The mirror apt already uses here (deb822 or one-line sources), else Debian's redirector.
  local m
  m=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2> /dev/null |
      grep -oE 'https?://[^ ]+' | head -1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}

base() {
  local client
  client=$(docker_client)
  if [ -n "${AF_BASE_IMAGE:-}" ]; then say "base image: $AF_BASE_IMAGE (AF_BASE_IMAGE)"; return; fi
  if "$client" image inspect "$LOCAL_BASE" > /dev/null 2>&1; then say "base image $LOCAL_BASE exists"; return; fi
  command -v debootstrap > /dev/null 2>&1 || die "debootstrap is missing (apt-get install -y debootstrap)"
  local dir
  dir=$(mktemp -d /tmp/astraflow-base.XXXXXX)
  say "making $LOCAL_BASE with debootstrap from $(mirror) (about 2 minutes)"
  debootstrap --variant=minbase bookworm "$dir" "$(mirror)" > "$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; rm -rf "$dir"; die "debootstrap failed"; }
  tar -C "$dir" -c . | "$client" import - "$LOCAL_BASE" > /dev/null
  rm -rf "$dir" "$dir.log"
}

build() {
  local client base_image torch secret=() extra
  client=$(docker_client)
  base_image=${AF_BASE_IMAGE:-$LOCAL_BASE}
  torch=${AF_TORCH_INDEX_URL:-}
  if [ -z "$torch" ]; then
    if curl -sf --max-time 10 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2> /dev/null; then
      torch=https://download.pytorch.org/whl/cpu
    else
      torch=https://pypi.org/simple   # CUDA wheels: larger, but they run on CPU
      say "the CPU torch index does not answer here: torch comes from PyPI"
    fi
  fi
  # Certificates this host trusts beyond the system's (a TLS-inspecting proxy): a build secret,
  # so pip and Maven inside the build trust them too; the images do not keep them.
  mkdir -p "$STATE"
  extra=$STATE/extra-ca.pem
  cat /usr/local/share/ca-certificates/*.crt > "$extra" 2> /dev/null || : > "$extra"
  [ -s "$extra" ] && secret=(--secret "id=extra_ca,src=$extra")
  local kafka_version
  kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' docker/kafka/pom.xml)
  local t0=$SECONDS
  say "building astraflow/kafka:$kafka_version (Kafka jars from docker/kafka/pom.xml)"
  "$client" build -q "${secret[@]}" --build-arg "BASE_IMAGE=$base_image" \
    -t "astraflow/kafka:$kafka_version" -f docker/kafka/Dockerfile docker/kafka > /dev/null
  say "building astraflow/prometheus:local"
  "$client" build -q --build-arg "BASE_IMAGE=$base_image" \
    -t astraflow/prometheus:local -f docker/prometheus/Dockerfile docker/prometheus > /dev/null
  say "building astraflow:cpu (the first build downloads torch: many minutes)"
  "$client" build -q "${secret[@]}" --build-arg "BASE_IMAGE=$base_image" --build-arg "TORCH_INDEX_URL=$torch" \
    -t astraflow:cpu -f docker/Dockerfile . > /dev/null
  say "images built in $((SECONDS - t0)) s"
  if [ "${AF_REGISTRY:-0}" = 1 ]; then build_registry; fi
}

# Apicurio needs Java 21+, which bookworm lacks: the image gets the application and a runtime
# jlinked from this host's JDK, both staged by `astraflow registry bundle` (astraflow/registry_image.py).
build_registry() {
  local client version py ctx t0=$SECONDS
  client=$(docker_client)
  version=$(sed -n 's:.*<apicurio.version>\(.*\)</apicurio.version>.*:\1:p' docker/registry/pom.xml)
  py=${AF_PYTHON:-$(bash scripts/env.sh)/bin/python}
  ctx=$STATE/registry-context
  say "staging the registry image's context in $ctx (first run: Apicurio from Maven Central, a jlinked Java runtime)"
  "$py" -m astraflow_cli.main registry bundle "$ctx" >&2
  say "building astraflow/registry:$version"
  "$client" build -q --build-arg "BASE_IMAGE=${AF_BASE_IMAGE:-$LOCAL_BASE}" \
    -t "astraflow/registry:$version" -f docker/registry/Dockerfile "$ctx" > /dev/null
  say "registry image built in $((SECONDS - t0)) s"
}

dc() {
  local cmd
  cmd=$(compose_cmd) || die "no docker compose (apt-get install -y docker-compose)"
  # shellcheck disable=SC2086
  $cmd -p "$PROJECT" -f "$COMPOSE_FILE" "${PROFILES[@]}" "$@"
}

up() {
  local n=${AF_RAAS:-2} timeout=${AF_UP_TIMEOUT:-900}
  say "starting project $PROJECT with $n RaaS node(s)"
  dc up -d --no-build --scale "raas=$n"
  local t0=$SECONDS
  while :; do
    local states
    states=$(dc ps -q | xargs -r "$(docker_client)" inspect \
      --format '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} {{.State.ExitCode}}')
    local bad
    bad=$(echo "$states" | awk '$2 == "exited" && $4 != 0')
    [ -z "$bad" ] || { echo "$bad" >&2; die "a container exited with an error: see docker logs"; }
    if ! echo "$states" | awk '$2 == "running" && $3 != "healthy" && $3 != "-"' | grep -q .; then break; fi
    [ $((SECONDS - t0)) -lt "$timeout" ] || { echo "$states" >&2; die "not healthy after $timeout s"; }
    sleep 5
  done
  where
}

where() {
  local kport=${AF_KAFKA_HOST_PORT:-49092} mport=${AF_METRICS_PORT:-49464} pport=${AF_PROMETHEUS_PORT:-49090}
  cat << EOF
AstraFlow stack "$PROJECT" is up (cd $ROOT).
  containers:   $(compose_cmd) -p $PROJECT -f docker/docker-compose.yml --profile cpu ps
  logs:         $(compose_cmd) -p $PROJECT -f docker/docker-compose.yml --profile cpu logs -f trainer raas
  status:       $(compose_cmd) -p $PROJECT -f docker/docker-compose.yml run --rm status
  Prometheus:   http://localhost:$pport  (e.g. astraflow_published_version, astraflow_tokens_per_s; docs/metrics.md)
  Kafka-level metrics: http://localhost:$mport/metrics
  Kafka:        localhost:$kport (astraflow --set kafka.bootstrap_servers=localhost:$kport status -e ${AF_EXPERIMENT:-demo})
  more nodes:   $(compose_cmd) -p $PROJECT -f docker/docker-compose.yml --profile cpu up -d --no-recreate --scale raas=4
  stop:         bash scripts/compose.sh down      (add -v to delete the volumes)
EOF
  if [ "${AF_REGISTRY:-0}" = 1 ]; then
    echo "  schema registry: http://localhost:${AF_REGISTRY_HOST_PORT:-49081}/apis/ccompat/v7 (roles: $AF_SCHEMA_REGISTRY_URL)"
  fi
}

case "${1:-all}" in
  all) engine; base; build; up ;;
  engine) engine ;;
  engine-stop) engine_stop ;;
  base) engine; base ;;
  build) build ;;
  build-registry) build_registry ;;
  up) up ;;
  where) where ;;
  down) shift; dc down --remove-orphans "$@" ;;
  compose) shift; dc "$@" ;;
  *) die "unknown command ${1}: all | engine | base | build | build-registry | up | where | down [-v] | engine-stop | compose ARGS" ;;
esac
