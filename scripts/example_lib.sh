# Shared by minirl_example.sh, grpo_example.sh and eval_example.sh (sourced, not run).
#
# Starts what the environment does not provide (embedded database, `agentrl engine`, samplers), remembers the PID
# of every process it started and stops exactly those on exit, failure or Ctrl-C (never by name).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AGENTRL="$ROOT/.venv/bin/agentrl"
PYTHON="$ROOT/.venv/bin/python"
STARTED_PIDS=()
STARTED_NAMES=()
STOP_EMBEDDED_DB=""

log() { printf '\033[1m[%s]\033[0m %s\n' "$(date +%H:%M:%S)" "$*"; }

stop_started() {
  local status=$?
  trap - EXIT INT TERM
  local i pid deadline
  for ((i = ${#STARTED_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${STARTED_PIDS[$i]}
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      deadline=$((SECONDS + 30))
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
      if kill -0 "$pid" 2>/dev/null; then
        log "${STARTED_NAMES[$i]} (pid $pid) did not stop within 30 s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
  done
  if [ -n "$STOP_EMBEDDED_DB" ]; then
    "$AGENTRL" db stop --data_dir "$STOP_EMBEDDED_DB" >/dev/null 2>&1 || true
  fi
  exit "$status"
}

# setup RUN_NAME: install .venv (idempotent), create the run directory, install the cleanup trap.
setup() {
  RUN_NAME=$1
  "$ROOT/scripts/setup_venv.sh"
  RUN_DIR=${RUN_DIR:-"$ROOT/runs/$RUN_NAME"}
  mkdir -p "$RUN_DIR/logs"
  trap stop_started EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
}

# start_background NAME COMMAND...: run COMMAND with its output in $RUN_DIR/logs/NAME.log; remember its PID.
start_background() {
  local name=$1
  shift
  "$@" >"$RUN_DIR/logs/$name.log" 2>&1 &
  STARTED_PIDS+=($!)
  STARTED_NAMES+=("$name")
}

# run_and_wait NAME COMMAND...: run COMMAND showing its output (also in $RUN_DIR/logs/NAME.log) until it exits.
# It runs in the background so that a signal to this script is handled at once (by stopping what was started).
run_and_wait() {
  local name=$1
  shift
  "$@" > >(tee "$RUN_DIR/logs/$name.log") 2>&1 &
  STARTED_PIDS+=($!)
  STARTED_NAMES+=("$name")
  local status=0
  wait "${STARTED_PIDS[-1]}" || status=$?
  return "$status"
}

# use_database: DB_URI from MONGO_URI (a server; the run name becomes the database) or the embedded server.
use_database() {
  if [ -n "${MONGO_URI:-}" ]; then
    local base=${MONGO_URI%%\?*}
    local query=${MONGO_URI:${#base}}
    base=${base%/}
    DB_URI="$base/$RUN_NAME$query"
    log "database: MongoDB at ${base##*@} (database $RUN_NAME)"
  else
    # A server of its own per run (data in the run directory), so runs never share or stop each other's server.
    local data_dir=${AGENTRL_DB_DIR:-"$RUN_DIR/db"} port_flags=()
    if [ -n "${AGENTRL_DB_PORT:-}" ]; then
      port_flags=(--port "$AGENTRL_DB_PORT")
    elif [ ! -f "$data_dir/nx-27017.port" ]; then
      port_flags=(--port 0)
    fi
    if ! "$AGENTRL" db status --data_dir "$data_dir" 2>/dev/null | grep -q '^running'; then
      STOP_EMBEDDED_DB=$data_dir  # started here, so stopped here (its data stays: `agentrl db start` reopens it)
    fi
    local server
    server=$("$AGENTRL" db start --data_dir "$data_dir" "${port_flags[@]}" | tail -n 1)
    case $server in mongodb://*) ;; *) log "the embedded database did not start: $server"; exit 1 ;; esac
    DB_URI="${server%/}/$RUN_NAME"
    log "database: embedded NX-27017 server $server (data in $data_dir, database $RUN_NAME)"
  fi
}

# use_inference: the SGLang servers in SGLANG_URLS, or an `agentrl engine` on MODEL started here (ENGINE_URL);
# SAMPLER_INFERENCE_FLAGS holds the matching `--inference_urls` flag.
use_inference() {
  SAMPLER_INFERENCE_FLAGS=()
  if [ -n "${SGLANG_URLS:-}" ]; then
    SAMPLER_INFERENCE_FLAGS=(--inference_urls "$SGLANG_URLS")
    log "inference: SGLang at $SGLANG_URLS"
    return
  fi
  start_background engine "$AGENTRL" engine ${MODEL:+--model_name_or_path "$MODEL"} --port 0 \
    --db_connection_string "$DB_URI" --num_threads "${ENGINE_THREADS:-2}" --max_running_requests 64
  local pid=${STARTED_PIDS[-1]} deadline=$((SECONDS + ${ENGINE_STARTUP_S:-600}))
  log "inference: starting agentrl engine on ${MODEL:-the embedded SmolLM2-135M-Instruct} (log $RUN_DIR/logs/engine.log)"
  until grep -q "agentrl engine ready at" "$RUN_DIR/logs/engine.log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$RUN_DIR/logs/engine.log"; log "the engine failed to start"; exit 1; }
    ((SECONDS < deadline)) || { log "the engine did not start within ${ENGINE_STARTUP_S:-600} s"; exit 1; }
    sleep 0.5
  done
  ENGINE_URL=$(sed -n 's/.*agentrl engine ready at \(http:[^ ]*\).*/\1/p' "$RUN_DIR/logs/engine.log" | head -n 1)
  SAMPLER_INFERENCE_FLAGS=(--inference_urls "$ENGINE_URL")
  log "inference: $(grep -o 'agentrl engine ready at .*' "$RUN_DIR/logs/engine.log" | head -n 1)"
}

# use_tools: MCP_CONFIG, or the built-in calculator (started over stdio by each sampler).
use_tools() {
  if [ -z "${MCP_CONFIG:-}" ]; then
    MCP_CONFIG="$RUN_DIR/mcp.json"
    cat >"$MCP_CONFIG" <<EOF
{"servers": [{"name": "calculator", "command": "$AGENTRL", "args": ["tools", "serve", "calculator"]}]}
EOF
  fi
  log "tools: MCP servers of $MCP_CONFIG"
}

# upload_tasks FILE SPLIT NUM_GENERATIONS [LIMIT]: the first LIMIT tasks of FILE into SPLIT; with SCORER set,
# every task is scored by that scorer (overriding the tasks' own `scorer` fields).
upload_tasks() {
  local file=$1 split=$2 generations=$3 limit=${4:-}
  if [ -n "$limit" ] || [ -n "${SCORER:-}" ]; then
    "$PYTHON" - "$file" "$RUN_DIR/tasks.jsonl" "${limit:-0}" "${SCORER:-}" <<'PY'
import json, sys
source, target, limit, scorer = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(source, encoding="utf-8") as lines, open(target, "w", encoding="utf-8") as out:
    for number, line in enumerate(lines):
        if limit and number >= limit:
            break
        task = json.loads(line)
        if scorer:
            task["scorer"] = scorer
        out.write(json.dumps(task) + "\n")
PY
    file="$RUN_DIR/tasks.jsonl"
  fi
  "$AGENTRL" tasks upload "$file" --db_connection_string "$DB_URI" --split "$split" \
    --num_generations "$generations"
}

# start_samplers COUNT FLAGS...: COUNT `agentrl sample` processes with the common and the given flags.
start_samplers() {
  local count=$1
  shift
  local i
  for ((i = 0; i < count; i++)); do
    start_background "sampler-$i" "$AGENTRL" sample --db_connection_string "$DB_URI" \
      ${MODEL:+--model_name_or_path "$MODEL"} --mcp_config "$MCP_CONFIG" "${SAMPLER_INFERENCE_FLAGS[@]}" "$@"
  done
  log "samplers: $count process(es) (logs $RUN_DIR/logs/sampler-*.log)"
}

# trainer_command: the launcher of the trainer (accelerate with ACCELERATE_CONFIG, else one process).
trainer_command() {
  if [ -n "${ACCELERATE_CONFIG:-}" ]; then
    TRAINER=("$ROOT/.venv/bin/accelerate" launch --config_file "$ACCELERATE_CONFIG" -m agentrl.train)
  elif [ "${NPROC:-1}" -gt 1 ]; then
    TRAINER=("$ROOT/.venv/bin/torchrun" --nproc_per_node "$NPROC" -m agentrl.train)
  else
    TRAINER=("$PYTHON" -m agentrl.train)
  fi
}

# summary OUTPUT_DIR: where things are and how the run went.
summary() {
  local output_dir=$1
  echo
  "$AGENTRL" status --db_connection_string "$DB_URI" || true
  echo
  log "run $RUN_NAME finished"
  echo "  trained model:     $output_dir/final   (agentrl chat --model_name_or_path $output_dir/final)"
  echo "  checkpoints:       $output_dir/checkpoint-*"
  echo "  trajectories:      database $RUN_NAME — agentrl export --db_connection_string '$DB_URI' --out records.jsonl"
  echo "                     or Mongo Compass on ${DB_URI%/*} (collections Record, DispatchedSamplingTask)"
  if [ -n "$STOP_EMBEDDED_DB" ]; then
    echo "                     (the embedded database stopped with this script: agentrl db start --data_dir $STOP_EMBEDDED_DB)"
  fi
  echo "  logs:              $RUN_DIR/logs"
}

# rl_example LOSS_NAME TRAINER_LOSS_FLAGS...: the whole training example (database, tools, tasks, inference,
# samplers, trainer, summary) with the given loss flags; configured by the variables of the calling script.
rl_example() {
  local loss_name=$1
  shift
  OUTPUT_DIR=${OUTPUT_DIR:-"$RUN_DIR/output"}
  TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-4}
  TEMPERATURE=${TEMPERATURE:-0.7}
  SCORER=${SCORER-math_format}
  MAX_STALENESS=${MAX_STALENESS:-1}

  use_database
  use_tools
  upload_tasks "${TASKS:-$ROOT/assets/tasks/arith_tools.jsonl}" train "${NUM_GENERATIONS:-4}" "${NUM_TASKS:-16}"
  use_inference
  start_samplers "${NUM_SAMPLERS:-1}" --max_concurrent_samples_per_process "${SAMPLES_PER_SAMPLER:-16}" \
    --max_turns "${MAX_TURNS:-2}" --max_new_tokens "${MAX_NEW_TOKENS:-96}" --temperature "$TEMPERATURE" \
    --train_batch_size "$TRAIN_BATCH_SIZE" --max_staleness "$MAX_STALENESS" ${EXTRA_SAMPLE_FLAGS:-}

  trainer_command
  log "trainer: $loss_name, up to ${TRAIN_STEPS:-8} steps of $TRAIN_BATCH_SIZE samples (output $OUTPUT_DIR)"
  run_and_wait trainer "${TRAINER[@]}" --db_connection_string "$DB_URI" ${MODEL:+--model_name_or_path "$MODEL"} \
    --output_dir "$OUTPUT_DIR" "$@" --learning_rate "${LEARNING_RATE:-1e-5}" \
    --train_batch_size "$TRAIN_BATCH_SIZE" --max_steps "${TRAIN_STEPS:-8}" --temperature "$TEMPERATURE" \
    --max_staleness "$MAX_STALENESS" --save_steps "${SAVE_STEPS:-2}" --num_threads "${TRAINER_THREADS:-1}" \
    ${EXTRA_TRAIN_FLAGS:-} || { log "the trainer failed (log $RUN_DIR/logs/trainer.log)"; exit 1; }
  summary "$OUTPUT_DIR"
}
