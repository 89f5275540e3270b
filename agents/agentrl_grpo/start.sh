#!/usr/bin/env bash
# AgentRL as an AutoRL-Bench agent (`agentrl bench run --agent agentrl_grpo --task TASK`): warm start + MINIRL
# through this repository's minirl_example.sh, configured from the workspace by plan.py. A background loop
# submits the models that appear (the warmed-up model; the newest checkpoint whenever no evaluation is waiting)
# without waiting for their results, and the final model last (`agentrl bench run` grades what is still queued
# when the agent exits).
set -euo pipefail
AGENT_DIR=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$AGENT_DIR/../.." && pwd)

say() { printf '[agentrl_grpo %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

"$ROOT/scripts/setup_venv.sh" >/dev/null
eval "$("$ROOT/.venv/bin/python" "$AGENT_DIR/plan.py")"
say "task $TASK: warm-up ${WARMUP:-oracle} demonstrations, then MINIRL for up to ${TRAIN_TIME_S} s (run dir $RUN_DIR)"

submitted="$WORKSPACE/code/submitted.txt"
touch "$submitted"
submit() {  # submit MODEL_DIR without waiting for its grade, once per directory (the server copies it at once)
  local dir=$1
  grep -qxF "$dir" "$submitted" && return 0
  echo "$dir" >>"$submitted"
  say "submit $dir: $(curl -s -X POST "$GRADING_SERVER_URL/submit" -H 'Content-Type: application/json' \
    -d "{\"model_path\": \"$dir\", \"async\": true}" | head -c 400)"
}
pending() { curl -s "$GRADING_SERVER_URL/health" | "$ROOT/.venv/bin/python" -c \
  'import json, sys; print(json.load(sys.stdin).get("pending_evaluations", 0))' 2>/dev/null || echo 1; }
# Complete model directories appear by rename, so a config.json means a whole model. The warmed-up model is
# submitted at once; a checkpoint only while no evaluation is waiting (the newest one then), so the queue never
# grows longer than the training: on a CPU an evaluation takes longer than the steps between checkpoints.
watch_models() {
  while sleep 15; do
    local dir newest=""
    dir="$RUN_DIR/warmup/final"
    [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] && submit "$dir"
    for dir in $(ls -d "$OUTPUT_DIR"/checkpoint-* 2>/dev/null | sort -V); do  # by step
      [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] && newest=$dir
    done
    if [ -n "$newest" ] && [ "$(pending)" = 0 ]; then submit "$newest"; fi
  done
}
watch_models &
watcher=$!
trap 'kill $watcher 2>/dev/null || true' EXIT

status=0
"$ROOT/minirl_example.sh" "bench-$TASK" || status=$?
kill $watcher 2>/dev/null || true
if [ -f "$OUTPUT_DIR/final/config.json" ]; then
  submit "$OUTPUT_DIR/final"  # graded after the run if the queue is long: the orchestrator waits for it
fi
say "best so far: $(curl -s "$GRADING_SERVER_URL/best" | head -c 400)"
exit $status
