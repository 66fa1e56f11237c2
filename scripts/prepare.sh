# Sourced (not run) by scripts/demo.sh and scripts/test.sh: the setup both start with.
# Moves to the repository root, installs the system packages (scripts/system-deps.sh), creates or
# reuses the cached virtualenv (scripts/env.sh) and puts its bin/ first on PATH; sets ROOT and VENV.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/system-deps.sh
VENV=$(bash scripts/env.sh)
export PATH="$VENV/bin:$PATH"
