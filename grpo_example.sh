#!/usr/bin/env bash
# GRPO on the built-in calculator task: ./grpo_example.sh [RUN_NAME]
#
# With nothing configured it runs on this machine alone, in under 10 minutes on 2 CPU cores: the embedded database,
# the built-in calculator MCP server and task sets, `agentrl engine` serving the embedded SmolLM2-135M-Instruct,
# one sampler and the trainer. The run: held-out evaluation of the starting model, a warm-up (SFT on tool-use
# demonstrations made with the real calculator), held-out evaluation of the warmed model, GRPO with a live
# status line, held-out evaluation of the final model, and a summary (runs/RUN_NAME/summary.json).
# `agentrl run --preset cpu-demo` does all of it; this script gives it the same variables as minirl_example.sh
# (listed there; `agentrl run --help` says more about each), e.g. LORA_R=8 TRAIN_STEPS=16 ./grpo_example.sh my_run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_venv.sh"
source "$ROOT/scripts/example_lib.sh"
run_flags "${RL_VARIABLES[@]}"
exec "$ROOT/.venv/bin/agentrl" run --preset cpu-demo ${1:+--run_name "$1"} "${RUN_FLAGS[@]}" ${SCORER+"--scorer=$SCORER"} \
  --loss_name GRPO --loss_flags "--loss_calculater GRPO --token_level_loss true"
