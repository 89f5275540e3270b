#!/usr/bin/env bash
# Make the GPU check's kit in DIR (default .whl/, git-ignored): the cp312 manylinux wheels AgentRL needs on the GPU
# machines' image and does not find there, a trimmed bitsandbytes and the embedded model's tokenizer (see
# scripts/gpu/kit.py). Idempotent. Carry DIR along with the working tree and run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
exec .venv/bin/python scripts/gpu/kit.py "${1:-.whl}"
