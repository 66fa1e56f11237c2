#!/usr/bin/env bash
# The test command (README quick start, and what .ci/run calls).
#
# Sets up the cached virtualenv, starts the local Apache Kafka through `astraflow kafka up`
# (a no-op when it already runs; stopped again at the end if this script started it), checks
# lint and schema compatibility, then runs unit, integration, e2e and docker tests. The docker
# test (tests/docker: the compose stack built and run) needs a Docker engine: this script starts
# one (`scripts/compose.sh engine`, installing docker.io with apt where it is missing) and stops it
# at the end if it started it; ASTRAFLOW_SKIP_DOCKER=1 leaves the engine alone and the test skips.
# GPU tests skip themselves where no GPU is present. Extra arguments go to pytest.
# The `vllm` tests (tests/vllm) skip in that run: vLLM's CPU build needs its own torch, so they run
# afterwards in the virtualenv of scripts/vllm-env.sh (built once, ~5 minutes and 6.3 GB, then
# cached); ASTRAFLOW_SKIP_VLLM=1 leaves them out.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare.sh"  # repository root, system packages, venv on PATH

echo "== ruff"
ruff check astraflow astraflow_cli stream_apps trainers tests bench scripts

STARTED=0
DOCKER_STARTED=0
cleanup() {
  if [ "$STARTED" = 1 ] && [ -z "${ASTRAFLOW_KEEP_KAFKA:-}" ]; then
    astraflow kafka down || true
  fi
  if [ "$DOCKER_STARTED" = 1 ]; then
    bash scripts/compose.sh engine-stop || true
  fi
}
trap cleanup EXIT

if [ -z "${ASTRAFLOW_TEST_BOOTSTRAP:-}" ]; then
  if ! astraflow kafka status >/dev/null 2>&1; then
    STARTED=1
  fi
  echo "== kafka"
  astraflow kafka up
  export ASTRAFLOW_TEST_BOOTSTRAP=127.0.0.1:19092
fi

if [ -z "${ASTRAFLOW_SKIP_DOCKER:-}" ]; then
  echo "== docker engine"
  if ! { docker info || /usr/bin/docker info; } >/dev/null 2>&1; then
    DOCKER_STARTED=1
  fi
  bash scripts/compose.sh engine
  export ASTRAFLOW_REQUIRE_DOCKER=1
fi

echo "== pytest"
python -m pytest -p no:cacheprovider --durations=15 "$@"

if [ -z "${ASTRAFLOW_SKIP_VLLM:-}" ]; then
  echo "== pytest -m vllm (vLLM's CPU build, in its own virtualenv)"
  VLLM_VENV=$(bash scripts/vllm-env.sh)
  "$VLLM_VENV/bin/python" -m pytest -p no:cacheprovider --durations=10 -m vllm tests/vllm
fi
