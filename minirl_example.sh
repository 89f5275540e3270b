#!/usr/bin/env bash
# MINIRL on the built-in calculator task: ./minirl_example.sh [RUN_NAME]
#
# With nothing configured it runs on this machine alone, in about 10 minutes on 2 CPU cores with the install: the
# embedded database, the built-in calculator MCP server and task sets, `agentrl engine` serving the embedded
# SmolLM2-135M-Instruct, one sampler and the trainer. The run: held-out evaluation of the starting model, a warm-up
# (SFT on tool-use demonstrations made with the real calculator), held-out evaluation of the warmed model, MINIRL
# with a live status line, held-out evaluation of the final model, and a summary (runs/RUN_NAME/summary.json).
# `agentrl run --preset cpu-demo` does all of it (configs/cpu-demo.toml holds the demo's values); this script gives it
# the variables below, each an option of the same name in lower case (`agentrl run --help` says more about each):
#
#   MODEL              model to train and serve (Hugging Face directory; default: the embedded SmolLM2-135M)
#   MONGO_URI          MongoDB server, e.g. mongodb://user:pass@host:27017/?replicaSet=rs0 (default: embedded, in
#                      RUN_DIR/db or AGENTRL_DB_DIR, port AGENTRL_DB_PORT); the run name becomes the database name
#   SGLANG_URLS        comma-separated SGLang servers serving MODEL (default: an `agentrl engine` started here)
#   MCP_CONFIG         MCP servers file (default: the built-in calculator over stdio; none: no tools)
#   ENV, ENV_SERVER    textcraft | babyai | sciworld: train on that AgentGym environment instead (MAX_TURNS 12,
#                      TEMPERATURE 1.0, the environment's reward, WARMUP 64 oracle demonstrations for 2 epochs)
#   TASKS, NUM_TASKS, ROUNDS   RL task file (assets/tasks/arith_tools.jsonl), its first N tasks (200), and the
#                      rounds each is sampled in (1; from the second the curriculum skips tasks always or never solved)
#   SCORER             scorer of every RL task (math; math_format without a warm-up; empty: the tasks' own)
#   EVAL_TASKS, NUM_EVAL_TASKS   held-out tasks (assets/tasks/arith_heldout.jsonl), the first N scored greedily
#                      before and after training (64; 0: no evaluation)
#   WARMUP             demonstrations to fine-tune on before RL (32 with the embedded model, 0 with MODEL);
#                      WARMUP_TASKS, WARMUP_EPOCHS (1), WARMUP_LEARNING_RATE (1e-4; 3e-3 with LORA_R), WARMUP_THREADS
#   ENGINE_THREADS (one less than the CPUs), ENGINE_STARTUP_S (600), NUM_GENERATIONS (4), NUM_SAMPLERS (1),
#   SAMPLES_PER_SAMPLER (16), MAX_TURNS (2), MAX_NEW_TOKENS (48), TEMPERATURE (0.7), QUERY_PROMPT, SAVE_STEPS (8),
#   SAVE_TOTAL_LIMIT (1), TRAIN_STEPS (100), TRAIN_TIME_S (330: RL is bounded by time), TRAIN_BATCH_SIZE (4),
#   LEARNING_RATE (2e-6; 5e-5 with LORA_R), MAX_STALENESS (2), SYNC_EVERY (2: publish every 2 steps), TRAINER_THREADS
#   LORA_R, LORA_PUBLISH   LoRA rank (0: full fine-tuning) and what RL publishes: merged (default) or adapter
#   ACCELERATE_CONFIG  e.g. assets/accelerate/fsdp2.yml: launch the trainer with `accelerate launch` (GPUs)
#   NPROC              trainer processes with torchrun on CPU (gloo), when ACCELERATE_CONFIG is not set (1)
#   RUN_DIR, OUTPUT_DIR   run files (runs/RUN_NAME) and the trained model (RUN_DIR/output)
#   EXTRA_TRAIN_FLAGS, EXTRA_SAMPLE_FLAGS, EXTRA_EVAL_FLAGS   more flags for the trainer / `agentrl sample` / `eval`
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_venv.sh"
source "$ROOT/scripts/example_lib.sh"
run_flags "${RL_VARIABLES[@]}"
exec "$ROOT/.venv/bin/agentrl" run --preset cpu-demo ${1:+--run_name "$1"} "${RUN_FLAGS[@]}" ${SCORER+"--scorer=$SCORER"} \
  --loss_name MINIRL \
  --loss_flags "--loss_calculater MINIRL --token_level_loss false --strict_in_bound true --skip_length_normalization true"
