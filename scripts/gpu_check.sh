#!/usr/bin/env bash
# The GPU check (scripts/gpu/check.py): every CUDA path of AgentRL in one command, for a GPU machine without
# internet. Make the kit here first (scripts/gpu_wheels.sh writes .whl/), take .whl/ along with the working tree,
# and run there:   scripts/gpu_check.sh            (python3 with torch; about 10 minutes on one H200)
# Without CUDA:    scripts/gpu_check.sh --dry-run  (the CPU-side steps for real, the CUDA steps' arguments only)
# Results: $OUT/gpu_check.json and $OUT/gpu_check.log (OUT unset: ./gpu_check_out). Exit status 0: no step failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && [[ " $* " == *" --dry-run "* ]]; then
  PY=.venv/bin/python  # the dry run checks this checkout's own environment
fi
exec "$PY" scripts/gpu/check.py "$@"
