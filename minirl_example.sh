#!/usr/bin/env bash
# MINIRL on the built-in calculator task: ./minirl_example.sh [RUN_NAME]
#
# With nothing configured it runs on this machine alone, in under 10 minutes on 2 CPU cores: the embedded database,
# the built-in calculator MCP server and task sets, `agentrl engine` serving the embedded SmolLM2-135M-Instruct,
# one sampler and the trainer. The run: held-out evaluation of the starting model, a warm-up (SFT on tool-use
# demonstrations made with the real calculator), held-out evaluation of the warmed model, MINIRL with a live
# status line, held-out evaluation of the final model, and a summary (runs/RUN_NAME/summary.json).
# Set any of these to use your own parts:
#
#   MODEL              model to train and serve (Hugging Face directory; default: the embedded SmolLM2-135M)
#   MONGO_URI          MongoDB server, e.g. mongodb://user:pass@host:27017/?replicaSet=rs0 (default: embedded);
#                      the run name becomes the database name
#   SGLANG_URLS        comma-separated SGLang servers serving MODEL (default: an `agentrl engine` started here)
#   MCP_CONFIG         MCP servers file (default: the built-in calculator over stdio)
#   ENV                textcraft | babyai | sciworld: train on that AgentGym environment instead (episodes scored by
#                      the environment's reward; tasks from `agentrl envs tasks`, NUM_TASKS of the train split, all
#                      when unset; NUM_EVAL_TASKS of the test split held out; warm start on WARMUP oracle
#                      demonstrations (32 for textcraft and babyai; sciworld has no oracle); MAX_TURNS 12)
#   ENV_SERVER         with ENV: an AgentGym server of that environment (default: `agentrl envs serve ENV` here)
#   TASKS              RL task file (default: assets/tasks/arith_tools.jsonl); NUM_TASKS: first N of it (64)
#   SCORER             scorer of every RL task (math_format: 1 right, 0.1 for a boxed wrong answer; empty: the
#                      tasks' own scorers)
#   EVAL_TASKS         held-out tasks (default: assets/tasks/arith_heldout.jsonl); NUM_EVAL_TASKS: first N of
#                      them, scored greedily before and after training (16; 0: no evaluation)
#   WARMUP             demonstrations to fine-tune on before RL (default: 24 with the embedded model, 0 with
#                      MODEL); WARMUP_TASKS (assets/tasks/arith_warmup.jsonl), WARMUP_EPOCHS (1),
#                      WARMUP_LEARNING_RATE (1e-4; 3e-3 with LORA_R)
#   ENGINE_THREADS     CPU threads of the engine started here (2)
#   NUM_GENERATIONS    samples per task (4)          NUM_SAMPLERS    sampler processes (1)
#   SAMPLES_PER_SAMPLER concurrent trajectories per sampler (16)
#   MAX_TURNS          turns per trajectory (2)      MAX_NEW_TOKENS  tokens per LLM call (48)
#   TEMPERATURE        sampling temperature (0.7)    SAVE_STEPS      checkpoint every N steps (8)
#   TRAIN_STEPS        at most this many optimiser steps (8); the run also ends when every task is sampled
#   TRAIN_TIME_S       stop training after the step that passes this many seconds (default: no limit)
#   TRAIN_BATCH_SIZE   samples per step (4)          LEARNING_RATE   (5e-6; 5e-5 with LORA_R)
#   LORA_R             LoRA rank: adapters on every linear layer (alpha 32, no dropout) in the warm-up and RL, at
#                      10× the RL and 30× the warm-up learning rate; checkpoints hold the adapter, evaluations and
#                      the final model are merged
#                      (0: full fine-tuning, the default)
#   LORA_PUBLISH       with LORA_R: what RL publishes to the inference services: merged (full weights, the default)
#                      or adapter (the adapter alone; the engine started here gets --enable_lora, SGLANG_URLS
#                      servers need --enable-lora --max-lora-rank R --lora-target-modules all)
#   MAX_STALENESS      policy versions a sample may lag behind (1)
#   ACCELERATE_CONFIG  e.g. assets/accelerate/fsdp2.yml: launch the trainer with `accelerate launch` (GPUs)
#   NPROC              trainer processes with torchrun on CPU (gloo), when ACCELERATE_CONFIG is not set (1)
#   OUTPUT_DIR         checkpoints and the final model (default: runs/RUN_NAME/output)
#   EXTRA_TRAIN_FLAGS, EXTRA_SAMPLE_FLAGS   more flags for `agentrl.train` / `agentrl sample`
source "$(dirname "$0")/scripts/example_lib.sh"

setup "${1:-minirl-$(date +%Y%m%d-%H%M%S)}"
rl_example MINIRL --loss_calculater MINIRL --token_level_loss false --strict_in_bound true \
  --skip_length_normalization true
