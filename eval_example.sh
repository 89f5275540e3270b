#!/usr/bin/env bash
# Evaluate a model on a task file with `agentrl eval`: ./eval_example.sh [RUN_NAME]
#
# With nothing configured it runs on this machine alone: the embedded database, `agentrl engine` serving the
# embedded SmolLM2-135M-Instruct and the built-in calculator MCP server; it evaluates the first LIMIT tasks of
# the built-in task set and prints the result table (stored in the run's `Eval` collection and written as JSON).
# Running it again with the same RUN_NAME reuses the stored result (FORCE=1 recomputes it). `agentrl run --mode
# eval --preset cpu-eval` does all of it (configs/cpu-eval.toml holds the values below); this script gives it these
# variables (`agentrl run --help` names each one's option):
#
#   MODEL              model to evaluate (Hugging Face directory or checkpoint; default: the embedded SmolLM2);
#                      with SGLANG_URLS it only names the tokenizer
#   MONGO_URI          MongoDB server (default: embedded); the run name becomes the database name
#   SGLANG_URLS        comma-separated live SGLang / agentrl engine servers serving MODEL (default: an engine here)
#   MCP_CONFIG         MCP servers file (default: the built-in calculator over stdio; none: no tools)
#   ENV                textcraft|babyai|sciworld: evaluate on LIMIT tasks of that environment's test split (drawn
#                      with seed 0) through an `agentrl envs serve ENV` started here (ENV_SERVER: an AgentGym
#                      server URL instead); MAX_TURNS then defaults to 12
#   AGENT_CONFIG       agent config YAML with the LLM judge, for tasks scored by `agentcpm`
#   TASKS              task file, JSON or JSONL (default: assets/tasks/arith_tools.jsonl); LIMIT: first N (8; 0: all)
#   SCORER, ANSWER_SCHEMA  for tasks that name none (math, boxed)
#   K                  samples per task, for pass@K and avg@K (2)      REPEATS   repeat the K samples R times (1)
#   TEMPERATURE        sampling temperature, 0 for greedy (0.7)        SEED      sampling seed (0)
#   MAX_TURNS          LLM calls per trajectory (2)                     MAX_NEW_TOKENS  tokens per call (128)
#   CONCURRENCY        trajectories in flight (16)                      FORCE     1: recompute a stored result
#   ENGINE_THREADS     CPU threads of the engine started here (one less than the CPUs, at least 1)
#   EXTRA_EVAL_FLAGS   more `agentrl eval` flags, e.g. "--query_prompt '...' --max_prompt_tokens 8192"
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_venv.sh"
source "$ROOT/scripts/example_lib.sh"
run_flags "${EVAL_VARIABLES[@]}"
exec "$ROOT/.venv/bin/agentrl" run --mode eval --preset cpu-eval ${1:+--run_name "$1"} "${RUN_FLAGS[@]}"
