#!/usr/bin/env bash
# Set up (first time) with test extras, lint (scripts/lint.sh: ruff, import-linter, mypy) and run
# the test suite. Extra arguments go to pytest.
set -euo pipefail
EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
bash scripts/lint.sh
python -m pytest -q "$@"
