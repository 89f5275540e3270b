#!/usr/bin/env bash
# Install everything into .venv (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
exec .venv/bin/python -m pytest "$@"
