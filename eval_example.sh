#!/usr/bin/env bash
# Evaluate a model on a task file with `agentrl eval`: ./eval_example.sh [RUN_NAME]
#
# With nothing configured it runs on this machine alone: the embedded database, `agentrl engine` serving the
# embedded SmolLM2-135M-Instruct and the built-in calculator MCP server; it evaluates the first LIMIT tasks of
# the built-in task set and prints the result table (stored in the run's `Eval` collection and written as JSON).
# Running it again with the same RUN_NAME reuses the stored result (FORCE=1 recomputes it). Set any of these:
#
#   MODEL              model to evaluate (Hugging Face directory or checkpoint; default: the embedded SmolLM2);
#                      with SGLANG_URLS it only names the tokenizer
#   MONGO_URI          MongoDB server (default: embedded); the run name becomes the database name
#   SGLANG_URLS        comma-separated live SGLang / agentrl engine servers serving MODEL (default: an engine here)
#   MCP_CONFIG         MCP servers file (default: the built-in calculator over stdio)
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
#   ENGINE_THREADS     CPU threads of the engine started here (2)
#   EXTRA_EVAL_FLAGS   more `agentrl eval` flags, e.g. "--query_prompt '...' --max_prompt_tokens 8192"
source "$(dirname "$0")/scripts/example_lib.sh"

setup "${1:-eval-$(date +%Y%m%d-%H%M%S)}"
use_database
if [ -n "${ENV:-}" ]; then
  NUM_EVAL_TASKS=${LIMIT:-8}
  [ "$NUM_EVAL_TASKS" = "0" ] && NUM_EVAL_TASKS=$("$AGENTRL" envs tasks "$ENV" --split test | wc -l)
  use_env
  TASKS=$EVAL_TASKS
  MAX_TURNS=${MAX_TURNS:-12}
else
  use_tools
fi
use_inference
eval_flags=()
[ "${FORCE:-0}" = "1" ] && eval_flags+=(--force)
[ -n "${AGENT_CONFIG:-}" ] && eval_flags+=(--agent_config_path "$AGENT_CONFIG")
[ "${LIMIT:-8}" != "0" ] && eval_flags+=(--limit "${LIMIT:-8}")
run_and_wait eval "$AGENTRL" eval --db_connection_string "$DB_URI" ${MODEL:+--model_name_or_path "$MODEL"} \
  "${SAMPLER_INFERENCE_FLAGS[@]}" "${TOOL_FLAGS[@]}" \
  --tasks "${TASKS:-$ROOT/assets/tasks/arith_tools.jsonl}" \
  --scorer "${SCORER:-math}" --answer_schema "${ANSWER_SCHEMA:-boxed}" \
  --num_samples_per_task "${K:-2}" --repeats "${REPEATS:-1}" --temperature "${TEMPERATURE:-0.7}" \
  --seed "${SEED:-0}" --max_turns "${MAX_TURNS:-2}" --max_new_tokens "${MAX_NEW_TOKENS:-128}" \
  --max_concurrent_samples_per_process "${CONCURRENCY:-16}" --name "$RUN_NAME" \
  --output "$RUN_DIR/eval.json" "${eval_flags[@]}" ${EXTRA_EVAL_FLAGS:-} ||
  { log "the evaluation failed (log $RUN_DIR/logs/eval.log)"; exit 1; }
log "result: $RUN_DIR/eval.json; database $RUN_NAME, collection Eval (agentrl status --db_connection_string '$DB_URI')"
