#!/usr/bin/env bash
# The whole GPU run in one command (docs/gpu.md): preflight, the carried wheels, the suite's GPU
# part, parity with transformers and the GPU benchmarks, every figure in $OUT/gpu_run.json.
#   bash scripts/gpu_run.sh              # on the GPU machine, .gpurun/ carried (scripts/gpu_pack.py)
#   bash scripts/gpu_run.sh --dry-run    # here, on a CPU: the same stages at tiny sizes
# PYTHON picks the interpreter (default: python3, the GPU image's; a dry run prefers .venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ -z ${PYTHON:-} && " $* " == *" --dry-run "* && -x .venv/bin/python ]]; then
    PY=.venv/bin/python
fi
command -v "$PY" >/dev/null 2>&1 || { echo "gpu_run: no $PY on PATH (set PYTHON)" >&2; exit 2; }
exec "$PY" scripts/gpu_run.py "$@"
