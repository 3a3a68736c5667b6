#!/usr/bin/env bash
# Lint and type-check the repository as CI does (tools/test.sh runs this first). Settings: pyproject.toml.
#   bash tools/lint.sh          # ruff (megarl, tests, tools), then mypy (megarl)
#   bash tools/lint.sh --fix    # ruff fixes what it can (import order, unused noqa, ...) first
# The venv is the repository's .venv (tools/install.sh installs the pinned ruff and mypy there);
# set VENV to use another.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV=${VENV:-$ROOT/.venv}
rc=0
"$VENV/bin/ruff" check "$@" megarl tests tools || rc=1
"$VENV/bin/mypy" || rc=1
exit $rc
