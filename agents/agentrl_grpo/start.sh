#!/usr/bin/env bash
# AgentRL as an AutoRL-Bench agent (`agentrl bench run --agent agentrl_grpo --task TASK`): warm start + MINIRL
# through this repository's minirl_example.sh, configured from the workspace by plan.py. A background loop
# submits every model that appears (the warmed-up model, checkpoints, the final model) without waiting for its
# evaluation; the last submission waits for its result.
set -euo pipefail
AGENT_DIR=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$AGENT_DIR/../.." && pwd)

say() { printf '[agentrl_grpo %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

"$ROOT/scripts/setup_venv.sh" >/dev/null
eval "$("$ROOT/.venv/bin/python" "$AGENT_DIR/plan.py")"
say "task $TASK: warm-up ${WARMUP:-oracle} demonstrations, then MINIRL for up to ${TRAIN_TIME_S} s (run dir $RUN_DIR)"

submitted="$WORKSPACE/code/submitted.txt"
touch "$submitted"
submit() {  # submit MODEL_DIR [async]: once per directory
  local dir=$1 mode=${2:-true}
  grep -qxF "$dir" "$submitted" && return 0
  echo "$dir" >>"$submitted"
  say "submit $dir: $(curl -s -X POST "$GRADING_SERVER_URL/submit" -H 'Content-Type: application/json' \
    -d "{\"model_path\": \"$dir\", \"async\": $mode}" | head -c 400)"
}
watch_models() {  # complete model directories appear by rename, so a config.json means a whole model
  while sleep 15; do
    for dir in "$RUN_DIR/warmup/final" "$OUTPUT_DIR"/checkpoint-*; do
      [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] && submit "$dir"
    done
  done
}
watch_models &
watcher=$!
trap 'kill $watcher 2>/dev/null || true' EXIT

status=0
"$ROOT/minirl_example.sh" "bench-$TASK" || status=$?
kill $watcher 2>/dev/null || true
if [ -f "$OUTPUT_DIR/final/config.json" ]; then
  submit "$OUTPUT_DIR/final" false
fi
say "best: $(curl -s "$GRADING_SERVER_URL/best" | head -c 400)"
exit $status
