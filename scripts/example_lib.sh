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

# wait_until_ready NAME PATTERN TIMEOUT_S: wait until the last process started (NAME, by start_background) prints
# PATTERN in its log; exit with its last lines if it dies first or stays silent past TIMEOUT_S.
wait_until_ready() {
  local name=$1 pattern=$2 pid=${STARTED_PIDS[-1]} deadline=$((SECONDS + $3))
  until grep -q "$pattern" "$RUN_DIR/logs/$name.log" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -n 30 "$RUN_DIR/logs/$name.log"; log "$name failed to start"; exit 1; }
    ((SECONDS < deadline)) || { log "$name did not start within $3 s"; exit 1; }
    sleep 0.5
  done
}

# use_database: DB_URI from MONGO_URI (a server; the run name becomes the database) or the embedded server;
# database_uri NAME gives the URI of another database on the same server.
use_database() {
  if [ -n "${MONGO_URI:-}" ]; then
    local base=${MONGO_URI%%\?*}
    local query=${MONGO_URI:${#base}}
    DB_BASE=${base%/} DB_QUERY=$query
    DB_URI=$(database_uri "$RUN_NAME")
    log "database: MongoDB at ${DB_BASE##*@} (database $RUN_NAME)"
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
    DB_BASE=${server%/} DB_QUERY=""
    DB_URI=$(database_uri "$RUN_NAME")
    log "database: embedded NX-27017 server $server (data in $data_dir, database $RUN_NAME)"
  fi
}

database_uri() { printf '%s/%s%s' "$DB_BASE" "$1" "$DB_QUERY"; }

# use_inference: the SGLang servers in SGLANG_URLS, or an `agentrl engine` on MODEL started here (ENGINE_URL);
# SAMPLER_INFERENCE_FLAGS holds the matching `--inference_urls` flag.
use_inference() {
  SAMPLER_INFERENCE_FLAGS=()
  if [ -n "${SGLANG_URLS:-}" ]; then
    SAMPLER_INFERENCE_FLAGS=(--inference_urls "$SGLANG_URLS")
    log "inference: SGLang at $SGLANG_URLS"
    return
  fi
  local lora_flag=()
  [ "${LORA_PUBLISH:-merged}" = adapter ] && lora_flag=(--enable_lora)
  start_background engine "$AGENTRL" engine ${MODEL:+--model_name_or_path "$MODEL"} --port 0 \
    --db_connection_string "$DB_URI" --num_threads "${ENGINE_THREADS:-2}" --max_running_requests 64 "${lora_flag[@]}"
  log "inference: starting agentrl engine on ${MODEL:-the embedded SmolLM2-135M-Instruct} (log $RUN_DIR/logs/engine.log)"
  wait_until_ready engine "agentrl engine ready at" "${ENGINE_STARTUP_S:-600}"
  ENGINE_URL=$(sed -n 's/.*agentrl engine ready at \(http:[^ ]*\).*/\1/p' "$RUN_DIR/logs/engine.log" | head -n 1)
  SAMPLER_INFERENCE_FLAGS=(--inference_urls "$ENGINE_URL")
  log "inference: $(grep -o 'agentrl engine ready at .*' "$RUN_DIR/logs/engine.log" | head -n 1)"
}

# use_tools: MCP_CONFIG, or the built-in calculator (started over stdio by each sampler), or no tools
# (MCP_CONFIG=none); TOOL_FLAGS holds the matching sampler/eval flags (with QUERY_PROMPT's --query_prompt).
use_tools() {
  if [ "${MCP_CONFIG:-}" = none ]; then
    log "tools: none"
    TOOL_FLAGS=()
    return
  fi
  if [ -z "${MCP_CONFIG:-}" ]; then
    MCP_CONFIG="$RUN_DIR/mcp.json"
    cat >"$MCP_CONFIG" <<EOF
{"servers": [{"name": "calculator", "command": "$AGENTRL", "args": ["tools", "serve", "calculator"]}]}
EOF
  fi
  log "tools: MCP servers of $MCP_CONFIG"
  TOOL_FLAGS=(--mcp_config "$MCP_CONFIG")
}

# prompt_flags: --query_prompt QUERY_PROMPT for samplers, evaluations and demonstrations, when it is set.
prompt_flags() {
  PROMPT_FLAGS=()
  if [ -n "${QUERY_PROMPT:-}" ]; then PROMPT_FLAGS=(--query_prompt "$QUERY_PROMPT"); fi
}

# use_env: for ENV=textcraft|babyai|sciworld, one `agentrl envs serve ENV` shared by every sampler and evaluation
# (ENV_SERVER: use that AgentGym server instead), its task files (train split for RL, test split held out) and
# TOOL_FLAGS pointing the samplers at it.
use_env() {
  local url=${ENV_SERVER:-}
  if [ -z "$url" ]; then
    start_background env-server "$AGENTRL" envs serve "$ENV" --port 0
    wait_until_ready env-server "agentrl envs: serving $ENV at http" 300
    url=$(sed -n "s/.*agentrl envs: serving $ENV at \(http[^ ]*\).*/\1/p" "$RUN_DIR/logs/env-server.log" | head -n 1)
  fi
  log "environment: $ENV at $url (log $RUN_DIR/logs/env-server.log)"
  TOOL_FLAGS=(--env_server "$ENV=$url")
  "$AGENTRL" envs tasks "$ENV" --split train --seed 0 ${NUM_TASKS:+--num "$NUM_TASKS"} --output "$RUN_DIR/env-train.jsonl"
  "$AGENTRL" envs tasks "$ENV" --split test --seed 0 --num "${NUM_EVAL_TASKS:-16}" --output "$RUN_DIR/env-test.jsonl"
  EVAL_TASKS="$RUN_DIR/env-test.jsonl"
  TASKS="$RUN_DIR/env-train.jsonl"
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
      ${MODEL:+--model_name_or_path "$MODEL"} "${TOOL_FLAGS[@]}" "${PROMPT_FLAGS[@]}" "${SAMPLER_INFERENCE_FLAGS[@]}" "$@"
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
  log "run $RUN_NAME finished"
  echo "  summary:           $RUN_DIR/summary.json   (agentrl status --db_connection_string '$DB_URI' for the details)"
  echo "  trained model:     $output_dir/final   (agentrl chat --model_name_or_path $output_dir/final)"
  echo "  checkpoints:       $output_dir/checkpoint-*"
  echo "  trajectories:      database $RUN_NAME — agentrl export --db_connection_string '$DB_URI' --out records.jsonl"
  echo "                     or Mongo Compass on ${DB_URI%/*} (collections Record, DispatchedSamplingTask)"
  if [ -n "$STOP_EMBEDDED_DB" ]; then
    echo "                     (the embedded database stopped with this script: agentrl db start --data_dir $STOP_EMBEDDED_DB)"
  fi
  local dashboard_db="'$DB_BASE/$DB_QUERY'"
  [ -n "${MONGO_URI:-}" ] && dashboard_db='"$MONGO_URI"'  # never print credentials
  echo "  dashboard:         ${STOP_EMBEDDED_DB:+agentrl db start --data_dir $STOP_EMBEDDED_DB && }agentrl dashboard --db_connection_string $dashboard_db"
  echo "                     then open http://127.0.0.1:8080/runs/$RUN_NAME (curves, records, every token)"
  echo "  logs:              $RUN_DIR/logs"
}

# held_out_eval LABEL MODEL_FLAGS...: score the first NUM_EVAL_TASKS held-out tasks (greedy, fixed seed) with the
# model the flags name (--model_name_or_path DIR: an engine started for it; --inference_urls: live services);
# the result goes to $RUN_DIR/eval-LABEL.json and EVAL_RESULTS.
held_out_eval() {
  local label=$1
  shift
  local out="$RUN_DIR/eval-$label.json" started=$SECONDS
  log "held-out evaluation ($label): ${NUM_EVAL_TASKS} tasks of $(basename "$EVAL_TASKS"), greedy (log $RUN_DIR/logs/eval-$label.log)"
  "$AGENTRL" eval --tasks "$EVAL_TASKS" --limit "$NUM_EVAL_TASKS" --name "$RUN_NAME $label" \
    --db_connection_string "$DB_URI" "${TOOL_FLAGS[@]}" "${PROMPT_FLAGS[@]}" --answer_schema boxed \
    --max_turns "$MAX_TURNS" --max_new_tokens "$MAX_NEW_TOKENS" --temperature 0 --seed 0 --force \
    --engine_args "--num_threads ${ENGINE_THREADS:-2}" --output "$out" "$@" >"$RUN_DIR/logs/eval-$label.log" 2>&1 ||
    { tail -n 20 "$RUN_DIR/logs/eval-$label.log"; log "the held-out evaluation ($label) failed"; exit 1; }
  EVAL_RESULTS+=(--eval "$label=$out")
  "$PYTHON" - "$out" "$label" "$((SECONDS - started))" <<'PY'
import json, sys
data, label, seconds = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
m = data["metrics"]
rate = lambda v: "-" if v is None else f"{v:.3f}"
print(f"  {label}: accuracy {rate(m['accuracy'])} ({m['correct']}/{m['valid_samples']}), mean reward "
      f"{rate(m['mean_reward'])}, {m['errors']} errors ({seconds} s)")
PY
}

# warm_up MODEL_DIR: supervised warm start on WARMUP demonstrations of WARMUP_TASKS made with the real tools
# (`agentrl sft demos`), trained with CrossEntropy in a database of its own; WARM_MODEL is the result.
warm_up() {
  local base=$1 dir="$RUN_DIR/warmup" started=$SECONDS
  local warm_db
  warm_db=$(database_uri "$RUN_NAME-warmup")
  mkdir -p "$dir"
  if [ -n "${ENV:-}" ]; then
    log "warm-up: SFT on $WARMUP oracle demonstrations of $ENV train tasks (log $RUN_DIR/logs/warmup.log)"
  else
    local made_with="real tool calls"
    [ ${#TOOL_FLAGS[@]} -eq 0 ] && made_with="worked solutions"
    log "warm-up: SFT on $WARMUP demonstrations of $(basename "$WARMUP_TASKS") ($made_with${LORA_FLAGS[*]:+; rank-$LORA_R LoRA at $WARMUP_LEARNING_RATE}; log $RUN_DIR/logs/warmup.log)"
  fi
  {
    if [ -n "${ENV:-}" ]; then
      "$AGENTRL" envs demos "$ENV" --num "$WARMUP" --split train --seed 1 --output "$dir/demos.jsonl"
    else
      "$AGENTRL" sft demos "$WARMUP_TASKS" --limit "$WARMUP" --answer_schema boxed --tools "" \
        "${TOOL_FLAGS[@]}" "${PROMPT_FLAGS[@]}" --out "$dir/demos.jsonl"
    fi &&
    "$AGENTRL" sft upload "$dir/demos.jsonl" --db_connection_string "$warm_db" ${base:+--model_name_or_path "$base"} &&
    "$PYTHON" -m agentrl.train --db_connection_string "$warm_db" ${base:+--model_name_or_path "$base"} \
      --loss_calculater CrossEntropy --enable_sampling false --train_batch_size 8 \
      --num_train_epochs "${WARMUP_EPOCHS:-1}" --learning_rate "$WARMUP_LEARNING_RATE" --save_steps 0 "${LORA_FLAGS[@]}" \
      --num_threads "${WARMUP_THREADS:-2}" --output_dir "$dir"
  } >"$RUN_DIR/logs/warmup.log" 2>&1 || { tail -n 20 "$RUN_DIR/logs/warmup.log"; log "the warm-up failed"; exit 1; }
  grep -o 'step [0-9]* | loss [0-9.e-]*' "$RUN_DIR/logs/warmup.log" | tr '\n' ';' | sed 's/;$/\n/; s/;/; /g; s/^/  /'
  WARM_MODEL="$dir/final"
  log "warm-up done in $((SECONDS - started)) s: $WARM_MODEL"
}

# load_weights MODEL_DIR URL,...: make the given inference services serve MODEL_DIR as weight version 0.
load_weights() {
  "$PYTHON" - "$1" "$2" <<'PY'
import asyncio, sys
from agentrl.inference.client import SGLangClient

async def main(path: str, urls: str) -> None:
    for url in filter(None, urls.split(",")):
        async with SGLangClient(url) as client:
            await client.update_weights_from_disk(path, weight_version="0")

asyncio.run(main(sys.argv[1], sys.argv[2]))
PY
}

# rl_example LOSS_NAME TRAINER_LOSS_FLAGS...: the whole training example with the given loss flags, configured by
# the variables of the calling script: database, tools, tasks, held-out evaluation of the starting model, warm-up
# (SFT on demonstrations), RL (inference, samplers, trainer, live status line), held-out evaluation of the final
# model, summary (runs/RUN_NAME/summary.json).
rl_example() {
  local loss_name=$1
  shift
  local run_started=$SECONDS
  OUTPUT_DIR=${OUTPUT_DIR:-"$RUN_DIR/output"}
  TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-4}
  if [ -n "${ENV:-}" ]; then  # environment episodes: the environment's reward is the score
    SCORER=${SCORER:-}
    MAX_TURNS=${MAX_TURNS:-12}
    # A warm start the RL groups can learn from: with 32 demonstrations for one epoch the embedded model solved
    # 1/32 held-out TextCraft goals and every RL group had zero reward variance (nothing trained); 64 for two
    # epochs at 2e-4 reached 5/32, and sampling at temperature 1.0 gives groups with mixed rewards.
    WARMUP=${WARMUP:-$(case $ENV in textcraft|babyai) echo 64 ;; *) echo 0 ;; esac)}
    WARMUP_EPOCHS=${WARMUP_EPOCHS:-2}
    WARMUP_LEARNING_RATE=${WARMUP_LEARNING_RATE:-$([ "${LORA_R:-0}" = 0 ] && echo 2e-4 || echo 2e-3)}
    TEMPERATURE=${TEMPERATURE:-1.0}
  fi
  TEMPERATURE=${TEMPERATURE:-0.7}
  # LoRA (LORA_R > 0): adapters of that rank on every linear layer, alpha 32 at every rank (so the update's scale,
  # and the learning rate that suits it, do not depend on the rank), in the warm-up and in RL, at 10× the full
  # fine-tuning rate for RL ("LoRA Without Regret": LoRA's best rate is about 10× higher) and 30× for the short
  # warm-up: after 2 updates on the 24 calculator demonstrations the SFT loss was 0.13 with full fine-tuning at
  # 1e-4, 0.32 with rank 1, 8 or 32 at 1e-3, 0.21 at 3e-3 (and 0.53 with rank 8 at alpha 16, 1.06 with rank 1 at
  # alpha 2: alpha 2×rank starves small ranks). No LoRA dropout: it would make the trainer's logprobs noisy next to
  # the engine's, and it cost 1.1 GB of peak memory and 7 % of the tokens/s on the embedded model (bench/lora.py).
  LORA_FLAGS=()
  local lr_scale=1 warmup_scale=1
  if [ "${LORA_R:-0}" != "0" ]; then
    LORA_FLAGS=(--use_peft --lora_r "$LORA_R" --lora_alpha 32 --lora_target_modules all-linear
      --lora_dropout 0 --lora_publish "${LORA_PUBLISH:-merged}")
    lr_scale=10 warmup_scale=30
  fi
  case "${LORA_PUBLISH:-merged}" in
    merged) ;;
    adapter) [ "${LORA_R:-0}" != 0 ] || { log "LORA_PUBLISH=adapter needs LORA_R"; exit 2; } ;;
    *) log "LORA_PUBLISH must be merged or adapter, not '$LORA_PUBLISH'"; exit 2 ;;
  esac
  LEARNING_RATE=${LEARNING_RATE:-$(awk "BEGIN { print 5e-6 * $lr_scale }")}
  WARMUP_LEARNING_RATE=${WARMUP_LEARNING_RATE:-$(awk "BEGIN { print 1e-4 * $warmup_scale }")}
  SCORER=${SCORER-math_format}
  MAX_STALENESS=${MAX_STALENESS:-1}
  MAX_TURNS=${MAX_TURNS:-2}
  MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-48}
  EVAL_TASKS=${EVAL_TASKS:-"$ROOT/assets/tasks/arith_heldout.jsonl"}
  NUM_EVAL_TASKS=${NUM_EVAL_TASKS:-16}
  WARMUP_TASKS=${WARMUP_TASKS:-"$ROOT/assets/tasks/arith_warmup.jsonl"}
  WARMUP=${WARMUP:-$([ -z "${MODEL:-}" ] && echo 24 || echo 0)}  # the embedded model needs it; yours: if asked
  EVAL_RESULTS=()

  use_database
  prompt_flags
  if [ -n "${ENV:-}" ]; then
    use_env
    upload_tasks "$TASKS" train "${NUM_GENERATIONS:-4}"
  else
    use_tools
    upload_tasks "${TASKS:-$ROOT/assets/tasks/arith_tools.jsonl}" train "${NUM_GENERATIONS:-4}" "${NUM_TASKS:-64}"
  fi
  if [ "$NUM_EVAL_TASKS" != "0" ]; then
    if [ -n "${SGLANG_URLS:-}" ]; then
      held_out_eval before --inference_urls "$SGLANG_URLS" ${MODEL:+--model_name_or_path "$MODEL"}
    else
      held_out_eval before ${MODEL:+--model_name_or_path "$MODEL"}
    fi
  fi
  local start_model=${MODEL:-}
  if [ "$WARMUP" != "0" ]; then
    warm_up "${MODEL:-}"
    start_model=$WARM_MODEL
    if [ -n "${SGLANG_URLS:-}" ]; then
      load_weights "$WARM_MODEL" "$SGLANG_URLS"
      log "inference: the SGLang servers now serve $WARM_MODEL"
    fi
  fi
  MODEL=$start_model use_inference
  if [ "$WARMUP" != "0" ] && [ "$NUM_EVAL_TASKS" != "0" ]; then
    held_out_eval warmup --inference_urls "${SAMPLER_INFERENCE_FLAGS[1]}" --model_name_or_path "$start_model"
  fi
  MODEL=$start_model start_samplers "${NUM_SAMPLERS:-1}" \
    --max_concurrent_samples_per_process "${SAMPLES_PER_SAMPLER:-16}" --max_turns "$MAX_TURNS" \
    --max_new_tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --train_batch_size "$TRAIN_BATCH_SIZE" \
    --max_staleness "$MAX_STALENESS" ${EXTRA_SAMPLE_FLAGS:-}

  trainer_command
  local lora_note=""
  [ "${LORA_R:-0}" != 0 ] && lora_note=" with rank-$LORA_R LoRA adapters at $LEARNING_RATE, published ${LORA_PUBLISH:-merged},"
  log "trainer: $loss_name,$lora_note up to ${TRAIN_STEPS:-8} steps of $TRAIN_BATCH_SIZE samples (log $RUN_DIR/logs/trainer.log, output $OUTPUT_DIR)"
  start_background trainer "${TRAINER[@]}" --db_connection_string "$DB_URI" \
    ${start_model:+--model_name_or_path "$start_model"} --output_dir "$OUTPUT_DIR" "$@" \
    --learning_rate "$LEARNING_RATE" "${LORA_FLAGS[@]}" --train_batch_size "$TRAIN_BATCH_SIZE" --max_steps "${TRAIN_STEPS:-8}" \
    --temperature "$TEMPERATURE" --max_staleness "$MAX_STALENESS" --save_steps "${SAVE_STEPS:-8}" \
    --num_threads "${TRAINER_THREADS:-1}" ${TRAIN_TIME_S:+--max_train_time_s "$TRAIN_TIME_S"} ${EXTRA_TRAIN_FLAGS:-}
  local trainer_pid=${STARTED_PIDS[-1]} status=0
  # The live status line runs in the background so that a signal to this script is handled at once (`wait`
  # returns on a trapped signal; a foreground command would delay the trap until it exits).
  "$AGENTRL" watch --db_connection_string "$DB_URI" --until_pid "$trainer_pid" --label "$loss_name" &
  STARTED_PIDS+=($!)
  STARTED_NAMES+=(watch)
  wait "${STARTED_PIDS[-1]}" || true
  wait "$trainer_pid" || status=$?
  if [ "$status" != 0 ]; then
    tail -n 30 "$RUN_DIR/logs/trainer.log"
    log "the trainer failed with exit status $status (log $RUN_DIR/logs/trainer.log)"
    exit 1
  fi
  if [ "$NUM_EVAL_TASKS" != "0" ]; then
    held_out_eval after --inference_urls "${SAMPLER_INFERENCE_FLAGS[1]}" --model_name_or_path "$OUTPUT_DIR/final"
  fi
  echo
  "$AGENTRL" report --db_connection_string "$DB_URI" "${EVAL_RESULTS[@]}" --wall_s "$((SECONDS - run_started))" \
    --out "$RUN_DIR/summary.json"
  summary "$OUTPUT_DIR"
}
