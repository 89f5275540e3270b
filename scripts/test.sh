#!/usr/bin/env bash
# Install everything into .venv (idempotent) and run the test suite. Extra arguments go to pytest (one run).
# Without arguments: ruff, then the whole suite on the embedded NX-27017 server on four worker processes
# (AGENTRL_TEST_WORKERS), the store and resume tests also on SecantusDB, a second MongoDB implementation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
# Debian packages that some tests need, installed once (as root): without them those tests skip.
install_package() {  # COMMAND PACKAGE TESTS: install PACKAGE where COMMAND is missing, else say which TESTS skip
  command -v "$1" >/dev/null && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "$1 not found and not installed (needs root and apt-get: apt-get install $2): $3 skip" >&2
    return 0
  fi
  if ! apt-get install -y -q "$2" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q "$2" >/dev/null 2>&1 || echo "could not install $2 (apt-get install $2 failed): $3 skip" >&2
  fi
}
install_package chromium chromium "the dashboard's browser tests"  # a real headless Chromium drives its pages
install_package bwrap bubblewrap "the sandbox's bwrap-mode tests"  # the sandbox's preferred mechanism
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
echo "=== ruff (pyproject.toml [tool.ruff]) ==="
.venv/bin/ruff check --quiet --output-format concise . || { echo "ruff found the problems above (ruff check --fix fixes many)" >&2; exit 1; }
# Four worker processes on 2 cores: most tests also wait on the servers, engines and trainers they start
# (conftest.py keeps the tests of a module-scoped fixture on one worker and spreads the rest).
# The store and resume tests run on SecantusDB too, in the same pass (--also-secantus), unless AGENTRL_TEST_MONGO_URI
# names the one server to use.
parallel=(-n "${AGENTRL_TEST_WORKERS:-4}" --dist loadgroup --durations=30)
[ -n "${AGENTRL_TEST_MONGO_URI:-}" ] || parallel+=(--also-secantus)
exec .venv/bin/python -m pytest "${parallel[@]}"
