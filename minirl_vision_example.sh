#!/usr/bin/env bash
# MINIRL on the built-in picture tasks, with a vision-language model: ./minirl_vision_example.sh [RUN_NAME]
#
# The loop of minirl_example.sh with pictures, on this machine alone, on CPU: the embedded database, `agentrl engine`
# serving the embedded vision-language model (the embedded SmolLM2-135M-Instruct with a random vision tower of its
# own, a Qwen2.5-VL built once: no pretrained small VLM ships in a package here), one sampler and the trainer, on
# questions only a picture answers (assets/tasks/pictures_*.jsonl: colours, sides, counts of flat shapes). The run:
# held-out evaluation of the starting model, a warm-up (SFT on demonstrations with their pictures), held-out
# evaluation of the warmed model, MINIRL with a live status line, held-out evaluation of the final model, summary.
# `agentrl run --preset cpu-vision-demo` does it (configs/cpu-vision-demo.toml holds the demo's values); the variables
# of minirl_example.sh apply here too (its header lists them), e.g. TRAIN_TIME_S, NUM_EVAL_TASKS, WARMUP.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_venv.sh"
source "$ROOT/scripts/example_lib.sh"
run_flags "${RL_VARIABLES[@]}"
exec "$ROOT/.venv/bin/agentrl" run --preset cpu-vision-demo ${1:+--run_name "$1"} "${RUN_FLAGS[@]}" \
  ${SCORER+"--scorer=$SCORER"} --loss_name MINIRL \
  --loss_flags "--loss_calculater MINIRL --token_level_loss false --strict_in_bound true --skip_length_normalization true"
