#!/usr/bin/env bash
# Template AutoRL-Bench agent: `agentrl bench run --agent template --task TASK` runs this in $WORKSPACE/code with
# TASK, BASE_MODEL, MODEL_PATH, DATA_PATH, OUTPUT_DIR, WORKSPACE and GRADING_SERVER_URL set (see
# $WORKSPACE/instructions.md). Replace step 2 with real training.
set -euo pipefail

say() { printf '[template %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# 1. What is asked, and how long there is.
say "task $TASK; base model $MODEL_PATH; training data $(wc -l <"$DATA_PATH/train.jsonl") rows in $DATA_PATH"
say "grading server: $(curl -sf "$GRADING_SERVER_URL/health")"
say "time: $(curl -sf "$GRADING_SERVER_URL/time")"

# 2. "Train": a copy of the base model (your training goes here; save a Hugging Face directory with config.json
#    and weights; merge LoRA adapters before saving).
model="$OUTPUT_DIR/v1"
rm -rf "$model"
cp -rL "$MODEL_PATH" "$model"
say "saved $model"

# 3. Check and submit it (blocking: the reply comes when the evaluation is done), then ask for the best so far.
say "validate: $(curl -sf -X POST "$GRADING_SERVER_URL/validate" -H 'Content-Type: application/json' \
  -d '{"model_path": "output/v1"}')"
say "submit: $(curl -sf -X POST "$GRADING_SERVER_URL/submit" -H 'Content-Type: application/json' \
  -d '{"model_path": "output/v1"}')"
say "best: $(curl -sf "$GRADING_SERVER_URL/best")"
