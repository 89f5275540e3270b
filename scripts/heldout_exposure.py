"""How many held-out problems an agent meets by chance when it samples the public generators with seeds of its own.

    .venv/bin/python scripts/heldout_exposure.py [--secrets 3] [--seeds 40]

For each of ``--secrets`` random secrets (never this installation's), the generated scenarios' held-out sets are
built as `agentrl bench` builds them; then ``--seeds`` fresh seeds (outside ``PUBLIC_SEEDS``) sample the public
generators as an agent would (reasoning-gym's ``gsm_symbolic``, 3,000 problems a seed; AgentRL's arithmetic
generator, 400 a seed) and the held-out problems among them are counted. Prints one line per scenario: problems
sampled, held-out problems met (mean and range over the secrets).
"""

from __future__ import annotations

import argparse
import re
import secrets
import statistics

from agentrl.autorl_bench import data
from agentrl.envs.arith import generate_arith_tasks

_GSM_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")
FIRST_FRESH_SEED = 1000


def _normalized(text: str) -> str:
    return " ".join(_GSM_SUFFIX.sub("", text).split())


def sampled(scenario: str, seeds: range) -> set[str]:
    if scenario == "gsm8k":
        import reasoning_gym

        return {_normalized(item["question"]) for seed in seeds
                for item in reasoning_gym.create_dataset("gsm_symbolic", size=3000, seed=seed)}
    return {_normalized(row["query"]) for seed in seeds for row in generate_arith_tasks(400, seed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secrets", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    seeds = range(FIRST_FRESH_SEED, FIRST_FRESH_SEED + args.seeds)
    print(f"{'scenario':<10} {'sampled':>9} {'held out':>9} {'met (mean)':>11} {'met (range)':>12}")
    for scenario, field in (("arith", "query"), ("gsm8k", "question")):
        pool = sampled(scenario, seeds)
        met = []
        for _ in range(args.secrets):
            _, test = data.BUILDERS[scenario](secrets.token_bytes(32))
            met.append(len({_normalized(row[field]) for row in test} & pool))
        print(f"{scenario:<10} {len(pool):>9,} {len(test):>9} {statistics.mean(met):>11.2f} "
              f"{f'{min(met)}-{max(met)}':>12}")


if __name__ == "__main__":
    main()
