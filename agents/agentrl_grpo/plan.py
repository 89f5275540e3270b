"""Print the training recipe for this run as shell assignments (read by start.sh with eval).

Everything the recipe needs comes from the workspace: ``scenario.json`` (the evaluation protocol: prompt, answer
schema, turns, new tokens, tools or environment), the training data, and the time left (``GET /time``). The
trainer gets the time that remains after the warm-up's estimate and a margin for saving and the last submission.
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.request
from pathlib import Path

WARMUP_ESTIMATE_S = {"arith": 240, "textcraft": 600}
MARGIN_S = 150
# GSM8K: supervised learning on the worked solutions is what teaches a small model the most per CPU second
# (135M model, 2 cores: 512 solutions in one epoch take about 16 minutes and raise held-out accuracy from 0 to 10%),
# so the warm-up gets this share of the time at about this cost per solution; RL refines it in the rest.
GSM8K_WARMUP_SHARE, GSM8K_SECONDS_PER_DEMO, GSM8K_SETUP_S = 0.55, 1.9, 60


def main() -> None:
    workspace = Path(os.environ["WORKSPACE"])
    scenario = json.loads((workspace / "scenario.json").read_text())
    protocol = scenario["evaluation"]
    with urllib.request.urlopen(os.environ["GRADING_SERVER_URL"] + "/time", timeout=30) as reply:
        remaining = json.load(reply).get("remaining") or 3600.0
    task = scenario["id"]
    env = protocol.get("env")
    warmup_s = None  # the warm-up's estimated duration when it depends on its size (else WARMUP_ESTIMATE_S)
    settings = {
        "RUN_DIR": str(workspace / "code" / "run"),
        "MODEL": os.environ["MODEL_PATH"],
        "MAX_TURNS": protocol["max_turns"],
        "MAX_NEW_TOKENS": protocol["max_new_tokens"],
        "NUM_EVAL_TASKS": 0,  # the grading server evaluates; no held-out evaluation of our own
        "TRAIN_STEPS": os.environ.get("AGENT_TRAIN_STEPS", "400"),
        "SAVE_STEPS": 8,
        "EXTRA_TRAIN_FLAGS": "--save_total_limit 2",  # 1.6 GB a checkpoint; the grading server copies submissions
        "TEMPERATURE": 1.0,
    }
    if env:
        settings.update(ENV=env, MAX_TURNS=protocol["max_turns"])
    else:
        train = str(Path(os.environ["DATA_PATH"]) / "train.jsonl")
        with open(train, encoding="utf-8") as handle:
            rows = sum(1 for line in handle if line.strip())
        settings.update(TASKS=train, NUM_TASKS=rows, WARMUP_TASKS=train, QUERY_PROMPT=protocol["query_prompt"],
                        SCORER="math" if protocol["scorer"] == "math" else "",  # after the warm-up: no format credit
                        MCP_CONFIG="" if protocol.get("tools") == ["calculator"] else "none")
        if protocol.get("tools") not in ([], ["calculator"]):
            raise SystemExit(f"agentrl_grpo: tools {protocol['tools']} are not supported by this agent")
        warmup = (32, 1, "1e-4")
        if protocol["answer_schema"] == "gsm8k":
            demos = int(remaining * GSM8K_WARMUP_SHARE / GSM8K_SECONDS_PER_DEMO) // 8 * 8
            warmup = (max(64, min(rows, demos)), 1, "1e-4")
            warmup_s = int(GSM8K_SETUP_S + warmup[0] * GSM8K_SECONDS_PER_DEMO)
            settings["TEMPERATURE"] = 0.7
        settings.update(WARMUP=warmup[0], WARMUP_EPOCHS=warmup[1], WARMUP_LEARNING_RATE=warmup[2])
    train_s = int(remaining - (warmup_s or WARMUP_ESTIMATE_S.get(task, 300)) - MARGIN_S)
    if train_s < 60:
        raise SystemExit(f"agentrl_grpo: only {remaining:.0f} s left: not enough to warm up and train")
    settings["TRAIN_TIME_S"] = train_s
    for key, value in settings.items():
        print(f"export {key}={shlex.quote(str(value))}")


if __name__ == "__main__":
    main()
