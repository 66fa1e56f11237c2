#!/usr/bin/env bash
# The first quick-start command: set up everything, start the local Kafka, run the main job.
# Extra arguments go to `astraflow demo`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/system-deps.sh
VENV=$(bash scripts/env.sh)
export PATH="$VENV/bin:$PATH"
astraflow kafka up
exec astraflow demo "$@"
