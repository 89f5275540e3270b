# Shared by minirl_example.sh, grpo_example.sh and eval_example.sh (sourced, not run): the environment variables
# users know, as options of `agentrl run` (which does the run: `agentrl run --help`).

# The variables of the training examples, each the option of its name in lower case (or of the name after ':').
RL_VARIABLES=(MODEL MONGO_URI AGENTRL_DB_DIR:db_dir AGENTRL_DB_PORT:db_port RUN_DIR SGLANG_URLS MCP_CONFIG ENV
  ENV_SERVER TASKS NUM_TASKS ROUNDS EVAL_TASKS NUM_EVAL_TASKS WARMUP WARMUP_TASKS WARMUP_EPOCHS WARMUP_LEARNING_RATE
  WARMUP_THREADS ENGINE_THREADS ENGINE_STARTUP_S NUM_GENERATIONS NUM_SAMPLERS SAMPLES_PER_SAMPLER MAX_TURNS
  MAX_NEW_TOKENS TEMPERATURE QUERY_PROMPT SAVE_STEPS SAVE_TOTAL_LIMIT TRAIN_STEPS TRAIN_TIME_S TRAIN_BATCH_SIZE
  LEARNING_RATE MAX_STALENESS SYNC_EVERY TRAINER_THREADS LORA_R LORA_PUBLISH ACCELERATE_CONFIG NPROC OUTPUT_DIR EXTRA_TRAIN_FLAGS
  EXTRA_SAMPLE_FLAGS EXTRA_EVAL_FLAGS VAL_BEFORE_TRAIN)
# The variables of eval_example.sh (`agentrl run --mode eval`).
EVAL_VARIABLES=(MODEL MONGO_URI AGENTRL_DB_DIR:db_dir AGENTRL_DB_PORT:db_port RUN_DIR SGLANG_URLS MCP_CONFIG ENV
  ENV_SERVER AGENT_CONFIG TASKS:eval_tasks LIMIT:num_eval_tasks SCORER ANSWER_SCHEMA K:eval_samples_per_task
  REPEATS:eval_repeats TEMPERATURE SEED:eval_seed MAX_TURNS MAX_NEW_TOKENS CONCURRENCY:samples_per_sampler FORCE
  ENGINE_THREADS ENGINE_STARTUP_S EXTRA_EVAL_FLAGS)

# run_flags VARIABLE[:option]...: RUN_FLAGS holds `--option=VALUE` for every VARIABLE set to a non-empty value.
run_flags() {
  RUN_FLAGS=()
  local spec name option
  for spec in "$@"; do
    name=${spec%%:*} option=${spec#*:}
    if [ -n "${!name:-}" ]; then RUN_FLAGS+=("--${option,,}=${!name}"); fi
  done
}
