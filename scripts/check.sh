#!/usr/bin/env bash
# Static checks (CI runs them before the tests): ruff lint and format, mypy over the scheduler,
# block manager and engine (settings in pyproject.toml). Needs `scripts/setup.sh test` first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
