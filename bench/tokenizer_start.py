"""What loading the policy's tokenizer costs a process that only tokenizes (a sampler, an evaluation), same run.

    .venv/bin/python bench/tokenizer_start.py [--model DIR] [--repeats 5]

Each side is a fresh ``python -c`` process that loads the tokenizer and renders one chat: **ours** through
``agentrl.inference.policy_tokenizer`` (``TokenizersBackend`` directly where ``AutoTokenizer`` would pick it), the
**baseline** through ``transformers.AutoTokenizer``, which imports torch. Measured from the parent: the child's CPU
seconds (user + system, from ``wait4``), its peak resident memory and its wall time; medians of ``--repeats`` runs,
the two sides alternating. Both sides must render the same token ids (checked). The default model is the embedded
model's tokenizer. Results are also written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOADERS = {
    "ours": "from agentrl.inference.policy_tokenizer import policy_tokenizer as load",
    "baseline": "from transformers import AutoTokenizer; load = AutoTokenizer.from_pretrained",
}
CHILD = """{loader}
import json, sys
tokenizer = load({path!r})
ids = tokenizer.apply_chat_template([{{"role": "user", "content": "What is 2+2?"}}], add_generation_prompt=True,
                                    return_dict=False)
print(json.dumps({{"ids": [int(i) for i in ids], "torch": "torch" in sys.modules}}))
"""


def measure(side: str, path: str) -> dict:
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", CHILD.format(loader=LOADERS[side], path=path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    out, err = process.stdout.read(), process.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"error: the {side} child failed:\n{err}")
    reply = json.loads(out.strip().splitlines()[-1])
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024, "wall_s": wall, **reply}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model's tokenizer)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.model is None:
        from agentrl.inference.embedded_model import default_tokenizer_path

        args.model = str(default_tokenizer_path())
    runs: dict[str, list[dict]] = {"ours": [], "baseline": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(measure(side, args.model))
    if len({tuple(r["ids"]) for side in runs.values() for r in side}) != 1 or len(runs["ours"][0]["ids"]) < 5:
        raise SystemExit("error: the two loaders rendered different token ids")
    table = {side: {key: statistics.median(r[key] for r in rows) for key in ("cpu_s", "rss_mb", "wall_s")}
             | {"imports_torch": rows[0]["torch"]} for side, rows in runs.items()}
    print(f"tokenizer of {args.model}, median of {args.repeats} fresh processes each")
    print(f"{'':10s} {'CPU s':>7s} {'peak RSS MB':>12s} {'wall s':>7s}  imports torch")
    for side, row in table.items():
        print(f"{side:10s} {row['cpu_s']:7.2f} {row['rss_mb']:12.0f} {row['wall_s']:7.2f}  {row['imports_torch']}")
    ours, base = table["ours"], table["baseline"]
    print(f"ours / baseline: CPU {ours['cpu_s'] / base['cpu_s']:.2f}, memory {ours['rss_mb'] / base['rss_mb']:.2f}, "
          f"wall {ours['wall_s'] / base['wall_s']:.2f}")
    out = REPO / "bench" / "results" / "tokenizer_start.json"
    out.write_text(json.dumps({"model": args.model, "repeats": args.repeats, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
