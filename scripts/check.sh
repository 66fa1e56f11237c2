#!/usr/bin/env bash
# The fast tier (`make check`): lint and the unit tests, no broker, no Docker, a few minutes.
#
# Sets up the cached virtualenv like the full suite does, then runs ruff and every test marked
# `unit` (tests/unit: pure functions, serde, configs, the schema compatibility gate) except those
# also marked `slow` (more than ~30 s each: `make test` runs them). Other issues' gates join here
# (a type checker, schema rules). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare.sh"  # repository root, system packages, venv on PATH

echo "== ruff"
ruff check astraflow astraflow_cli stream_apps trainers tests bench scripts

echo "== unit tests"
python -m pytest -p no:cacheprovider -m "unit and not slow" -q --durations=5 tests/unit "$@"
