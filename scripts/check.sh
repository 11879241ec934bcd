#!/usr/bin/env bash
# Static checks (CI runs them before the tests): ruff lint and format, mypy over the whole
# kvserve package (settings in pyproject.toml), clang-format over the C kernels
# (kvserve/csrc/.clang-format). Needs `scripts/setup.sh test` first.
# Fix formatting with: .venv/bin/ruff format . && .venv/bin/clang-format -i kvserve/csrc/*.[ch]
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/clang-format --dry-run --Werror kvserve/csrc/*.[ch]
