"""`agentrl envs list|serve|tasks|demos`: environments on the AgentGym HTTP protocol, their tasks and demonstrations."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("envs", help="AgentGym-protocol environments: list, serve, task files, demonstrations")
    actions = parser.add_subparsers(dest="envs_action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="the built-in environments: tasks per split, action format, oracle")
    listing.set_defaults(func=run_list)

    serve = actions.add_parser(
        "serve", help="serve one environment on AgentGym's HTTP routes",
        description="Serve environment NAME (a built-in, or a plugin MODULE:FUNCTION returning an EnvSpec) with "
                    "AgentGym's routes and payloads, so AgentGym's clients and ours both work with it.")
    serve.add_argument("name", metavar="NAME")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--instance_ttl_s", type=float, default=1800.0,
                       help="close instances idle for longer than this (default: 1800)")
    serve.add_argument("--images", action="store_true",
                       help="send a picture of every observation (an extra 'image' field, base64 PNG), for a "
                            "vision-language policy, where the environment draws one (BabyAI: the agent's view)")
    serve.set_defaults(func=run_serve)

    tasks = actions.add_parser(
        "tasks", help="write a task file (JSONL) for `agentrl tasks upload`",
        description="One row per task: query 'NAME task K', scorer env_reward, metadata env {name, data_idx}. "
                    "Upload with `agentrl tasks upload FILE --split SPLIT`.")
    _add_selection(tasks)
    tasks.add_argument("--num", type=int, default=None, help="number of tasks (default: the whole split)")
    tasks.set_defaults(func=run_tasks)

    demos = actions.add_parser(
        "demos", help="write oracle demonstrations (JSONL) for `agentrl sft upload`",
        description="Successful episodes of the environment's oracle, as OpenAI messages conversations.")
    _add_selection(demos)
    demos.add_argument("--num", type=int, required=True, help="number of demonstrations")
    demos.add_argument("--images", action="store_true",
                       help="show each observation's picture before its text (an image_url part, data: URI), as "
                            "`envs serve --images` does, for a vision-language policy (BabyAI: the agent's view)")
    demos.set_defaults(func=run_demos)


def _add_selection(parser: argparse.ArgumentParser) -> None:
    """NAME and the flags that pick its tasks (``--split``, ``--seed``) and say where the JSONL goes."""
    parser.add_argument("name", metavar="NAME")
    parser.add_argument("--split", default="train", help="the environment's split (default: train)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle that picks the tasks (default: 0)")
    parser.add_argument("--output", default=None, help="file to write (default: stdout)")


def run_list(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError, version

    from agentrl.envs.base import EnvError
    from agentrl.envs.registry import PACKAGES, get_spec, names

    rows = [("name", "tasks", "action format", "oracle", "package")]
    problems = []
    for name in names():
        package = PACKAGES.get(name, "")
        if package:
            try:
                package = f"{package} {version(package)}"
            except PackageNotFoundError:
                package = f"{package} (not installed)"
        try:
            spec = get_spec(name)
        except EnvError as error:
            rows.append((name, "unavailable", "-", "-", package))
            problems.append(f"{name}: {error}")
            continue
        splits = ", ".join(f"{split} {len(indices)}" for split, indices in spec.splits.items())
        rows.append((name, splits, spec.action_format, "yes" if spec.oracle else "no", package))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for problem in problems:
        print(problem, file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from agentrl.envs.server import serve

    return serve(args.name, args.host, args.port, instance_ttl_s=args.instance_ttl_s, images=args.images)


def run_tasks(args: argparse.Namespace) -> int:
    from agentrl.envs.base import EnvError
    from agentrl.envs.tasks import task_rows

    try:
        rows = task_rows(args.name, args.split, args.num, args.seed)
    except (EnvError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    _write_jsonl(rows, args.output)
    if args.output:
        print(f"wrote {len(rows)} {args.name} tasks ({args.split}) to {args.output}", file=sys.stderr)
    return 0


def run_demos(args: argparse.Namespace) -> int:
    from agentrl.envs.base import EnvError
    from agentrl.envs.tasks import demo_rows

    def progress(kept: int, tried: int) -> None:
        print(f"\rdemos: {kept}/{args.num} kept, {tried} episodes played", end="", file=sys.stderr, flush=True)

    try:
        rows = demo_rows(args.name, args.num, args.seed, args.split, progress=progress, images=args.images)
    except (EnvError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        print(file=sys.stderr)
    _write_jsonl(rows, args.output)
    if len(rows) < args.num:
        print(f"warning: only {len(rows)} of the {args.num} demonstrations asked for: the oracle did not succeed "
              f"often enough in split {args.split!r}", file=sys.stderr)
    return 0


def _write_jsonl(rows: list[dict], output: str | None) -> None:
    import json

    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
