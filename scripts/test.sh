#!/usr/bin/env bash
# Set up (first time) with test extras, lint (scripts/lint.sh: ruff, import-linter, mypy) and run
# the test suite: on two pytest-xdist workers (one test file per worker, so each file's fixtures are
# built once), then the tests marked `serial` alone (they time a step and skip unless the machine is
# otherwise idle). Extra arguments go to both pytest runs.
set -euo pipefail
EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh"
bash scripts/lint.sh
# the docs site (mkdocs.yml) with every warning an error: broken links, pages left out of the nav, bad
# docstring references; built into a scratch folder, not the checkout's site/
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
python -m pytest -q -n 2 --dist loadfile -m "not serial" "$@"
rc=0
python -m pytest -q -m serial -rs "$@" || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"  # 5: the arguments selected no serial test
