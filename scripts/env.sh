#!/usr/bin/env bash
# Prints the path of AstraFlow's virtualenv, creating it first if needed.
#
# The venv lives outside the clone (torch alone is several GB), in
# ${ASTRAFLOW_HOME:-~/.cache/astraflow}/venv-<hash>, keyed by a hash of the dependency lists in
# pyproject.toml, so every clone and every CI run with the same dependencies reuses it. The
# project itself is (re)installed in editable mode each time: that takes seconds and points
# the venv at this clone.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ASTRAFLOW_HOME:-$HOME/.cache/astraflow}
PY=${PYTHON:-python3}
HASH=$("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import hashlib, json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = {"deps": p["dependencies"], "extras": p.get("optional-dependencies", {}), "py": sys.version_info[:2]}
print(hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:12])
PYEOF
)
VENV=$CACHE/venv-$HASH
mkdir -p "$CACHE"
# One creator at a time: two runs that start together on a fresh machine (a demo and a test,
# or two clones) would otherwise each `rm -rf` the other's half-built venv. The lock is held
# to the end of this script (fd 9 closes on exit), so the editable install is serialised too.
exec 9> "$VENV.lock"
flock 9
if [ ! -f "$VENV/.complete" ]; then
  echo "[env] creating $VENV (first run downloads torch and friends; a few minutes)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip "setuptools>=69" wheel >&2
  # Dependencies only; the project itself is installed editable below.
  DEPS=$("$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["dev"] + p["optional-dependencies"]["bench"]))
PYEOF
)
  echo "$DEPS" > "$VENV/requirements.txt"
  "$VENV/bin/pip" install -q -r "$VENV/requirements.txt" >&2
  touch "$VENV/.complete"
fi
if [ "$(cat "$VENV/.installed-from" 2>/dev/null)" != "$ROOT" ] || ! "$VENV/bin/python" -c "import astraflow" 2>/dev/null; then
  if ! "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" > "$VENV/editable-install.log" 2>&1; then
    cat "$VENV/editable-install.log" >&2
    exit 1
  fi
  echo "$ROOT" > "$VENV/.installed-from"
fi
echo "$VENV"
