#!/usr/bin/env bash
# The house rules that tools check (docs/architecture.md, CONTRIBUTING.md): ruff (style, imports,
# bug patterns), mypy (types) and import-linter (one direction of imports between packages).
# Called by scripts/test.sh; run it alone after `EXTRAS=test source scripts/_setup.sh`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ] && [ -z "${VIRTUAL_ENV:-}" ]; then . .venv/bin/activate; fi
echo "lint: ruff"
ruff check --quiet .
echo "lint: import-linter"
lint-imports --no-cache >/dev/null || lint-imports --no-cache
echo "lint: mypy"
mypy
