"""Environment protocol overhead: episodes through our HTTP server versus the same episodes in-process, same run.

    .venv/bin/python bench/envs.py [--env textcraft] [--episodes 64] [--concurrency 1 8 32] [--repeats 3]

The episodes replay the environment's oracle on the first ``--episodes`` tasks of ``--split`` (the seeded order of
``agentrl envs tasks``); the actions are computed once, untimed. Each episode is create/build, reset, the
oracle's steps, close, on both sides:

* **http**: ``C`` asyncio workers in this process, each playing episodes one after the other with
  :class:`agentrl.envs.client.AgentGymClient` against one ``agentrl envs serve`` process (started once, untimed;
  it runs environment work in its thread pool);
* **in-process**: the same episodes, ``C`` of them open at once and stepped round robin by direct calls in one
  thread (the environments are Python: threads would add only GIL switching).

steps/s is the number of steps over the wall time of all episodes (their create/reset/close included); the ratio
http / in-process is what is left after the protocol's overhead (JSON, HTTP, the thread hop, two processes
sharing the CPU). Each figure is the median of ``--repeats`` runs; the two sides alternate. Both sides must end
with the same total reward (checked). Results are also written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agentrl.envs.base import EnvSpec
from agentrl.envs.client import AgentGymClient, episode_reward
from agentrl.envs.local import start_local_server
from agentrl.envs.registry import get_spec
from agentrl.envs.tasks import sampled_indices

REPO = Path(__file__).resolve().parent.parent
Episode = tuple[int, list[str]]
"""(data_idx, the oracle's actions)"""


def oracle_episodes(spec: EnvSpec, split: str, count: int, seed: int) -> list[Episode]:
    if spec.oracle is None:
        raise SystemExit(f"error: environment {spec.name!r} has no oracle to replay")
    return [(k, spec.oracle(k)) for k in sampled_indices(spec, split, count, seed)]


async def over_http(name: str, url: str, episodes: list[Episode], concurrency: int) -> tuple[float, float]:
    """(steps/s, total reward) with ``concurrency`` workers."""
    queue = iter(episodes)
    rewards: list[float] = []

    async def worker(client: AgentGymClient) -> None:
        for data_idx, actions in queue:
            instance = await client.create()
            await client.reset(instance, data_idx)
            rewards.append(episode_reward([await client.step(instance, action) for action in actions]))
            await client.close(instance)

    async with AgentGymClient(name, url) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return sum(len(a) for _, a in episodes) / elapsed, sum(rewards)


def in_process(spec: EnvSpec, episodes: list[Episode], concurrency: int) -> tuple[float, float]:
    """(steps/s, total reward) with ``concurrency`` episodes open at once, stepped round robin."""
    rewards: list[float] = []

    def play(data_idx: int, actions: list[str]) -> Iterator[None]:
        env = spec.factory()
        env.reset(data_idx)
        steps = []
        for action in actions:
            steps.append(env.step(action))
            yield
        env.close()
        rewards.append(episode_reward(steps))

    pending = iter(episodes)
    start = time.perf_counter()
    active = [play(*episode) for episode in itertools.islice(pending, concurrency)]
    while active:
        for game in list(active):
            if next(game, StopIteration) is StopIteration:
                active.remove(game)
                following = next(pending, None)
                if following is not None:
                    active.append(play(*following))
    elapsed = time.perf_counter() - start
    return sum(len(a) for _, a in episodes) / elapsed, sum(rewards)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="textcraft", help="environment name (or plugin MODULE:FUNCTION)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--episodes", type=int, default=64, help="episodes per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="JSON file (default: bench/results/envs-<time>.json)")
    args = parser.parse_args()

    spec = get_spec(args.env)
    episodes = oracle_episodes(spec, args.split, args.episodes, args.seed)
    steps = sum(len(actions) for _, actions in episodes)
    url, stop = start_local_server(args.env)
    rows = []
    try:
        for concurrency in args.concurrency:
            runs: dict[str, list[float]] = {"http": [], "in_process": []}
            same_reward = True
            for repeat in range(args.repeats):
                order = ("http", "in_process") if repeat % 2 == 0 else ("in_process", "http")
                totals = {}
                for side in order:
                    if side == "http":
                        rate, totals[side] = asyncio.run(over_http(args.env, url, episodes, concurrency))
                    else:
                        rate, totals[side] = in_process(spec, episodes, concurrency)
                    runs[side].append(rate)
                    print(f"  concurrency {concurrency:>2} {side:<10} {rate:9.1f} steps/s", file=sys.stderr)
                same_reward &= totals["http"] == totals["in_process"]
            ratios = [h / p for h, p in zip(runs["http"], runs["in_process"])]
            rows.append({"concurrency": concurrency, **runs, "ratio": statistics.median(ratios),
                         "same_reward": same_reward})
    finally:
        stop()

    print(f"\n{spec.name}: {len(episodes)} oracle episodes of split {args.split} ({steps} steps) per run, "
          f"median of {args.repeats}; ratio: median of the per-repeat ratios http/in-process\n")
    print("| concurrent episodes | in-process steps/s | http steps/s | ratio | same reward |")
    print("|---:|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['concurrency']} | {statistics.median(row['in_process']):.0f} | "
              f"{statistics.median(row['http']):.0f} | {row['ratio']:.3f} | {'yes' if row['same_reward'] else 'NO'} |")
    output = Path(args.output) if args.output else (
        REPO / "bench" / "results" / f"envs-{time.strftime('%Y%m%d-%H%M%S')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"env": spec.name, "args": vars(args), "steps_per_run": steps, "rows": rows},
                                 indent=2))
    print(f"written to {output}")
    return 0 if all(row["same_reward"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
