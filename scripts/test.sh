#!/usr/bin/env bash
# Install everything into .venv (idempotent) and run the test suite. Extra arguments go to pytest (one run).
# Without arguments: the whole suite on the embedded NX-27017 server, then the store, rollout and resume tests again
# on SecantusDB, a second MongoDB implementation (skipped when AGENTRL_TEST_MONGO_URI names a server to use).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
# The dashboard's page tests drive a real headless Chromium (Debian's package; installed once, as root).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! apt-get install -y -q chromium >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1 || true
    apt-get install -y -q chromium >/dev/null 2>&1 || echo "could not install chromium: the dashboard's browser test is skipped" >&2
  fi
fi
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
.venv/bin/python -m pytest || status=$?
if [ -z "${AGENTRL_TEST_MONGO_URI:-}" ]; then
  echo "=== the store, rollout and resume tests on SecantusDB ==="
  .venv/bin/python -m pytest --mongo-server=secantus tests/test_store_*.py tests/test_rollout_sampler.py \
    tests/test_trainer_resume.py --deselect tests/test_store_secantus_faults.py || { s=$?; [ "$status" -ne 0 ] || status=$s; }
fi
exit "$status"
