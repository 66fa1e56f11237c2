#!/usr/bin/env bash
# The test command (README quick start, and what .ci/run calls).
#
# Sets up the cached virtualenv, starts the local Apache Kafka through `astraflow kafka up`
# (a no-op when it already runs; stopped again at the end if this script started it), checks
# lint and schema compatibility, then runs unit, integration and e2e tests. GPU tests skip
# themselves where no GPU is present. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/system-deps.sh
VENV=$(bash scripts/env.sh)
export PATH="$VENV/bin:$PATH"

echo "== ruff"
ruff check astraflow stream_apps trainers tests bench

STARTED=0
if [ -z "${ASTRAFLOW_TEST_BOOTSTRAP:-}" ]; then
  if ! astraflow kafka status >/dev/null 2>&1; then
    STARTED=1
  fi
  echo "== kafka"
  astraflow kafka up
  if [ "$STARTED" = 1 ] && [ -z "${ASTRAFLOW_KEEP_KAFKA:-}" ]; then
    trap 'astraflow kafka down || true' EXIT
  fi
  export ASTRAFLOW_TEST_BOOTSTRAP=127.0.0.1:19092
fi

echo "== pytest"
python -m pytest -p no:cacheprovider --durations=15 "$@"
