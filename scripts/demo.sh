#!/usr/bin/env bash
# The first quick-start command: set up everything, start the local Kafka, run the main job.
# Extra arguments go to `astraflow demo`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare.sh"  # repository root, system packages, venv on PATH
astraflow kafka up
exec astraflow demo "$@"
