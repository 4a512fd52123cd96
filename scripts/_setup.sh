# Sourced by demo.sh and test.sh: create .venv if missing, install torch pinned and first
# (only when it is not importable: a version range would pull a multi-GB CUDA build),
# then the project. EXTRAS selects optional dependencies (pyproject.toml): "run,demo" for
# scripts/demo.sh, "test" (run, demo and the test tools) for scripts/test.sh; none: the planner.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  pip install -q "torch==2.13.0"
fi
spec="."
if [ -n "${EXTRAS:-}" ]; then spec=".[${EXTRAS}]"; fi
pip install -q -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
