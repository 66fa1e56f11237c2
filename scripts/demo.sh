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
if astraflow demo --help >/dev/null 2>&1; then
  exec astraflow demo "$@"
fi
# Until the learning demo lands: prove the installation with a round trip through Kafka.
exec astraflow smoke
