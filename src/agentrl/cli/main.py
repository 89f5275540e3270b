"""`agentrl` console script: dispatches to one module per sub-command.

Each module in ``SUBCOMMANDS`` exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (called with the parsed namespace, returns the exit code). Heavy imports happen inside ``func``
so that ``agentrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from agentrl.log import setup_logging

SUBCOMMANDS: tuple[str, ...] = (
    "agentrl.cli.db",
    "agentrl.cli.tasks",
    "agentrl.cli.export",
    "agentrl.cli.status",
    "agentrl.cli.watch",
    "agentrl.cli.report",
    "agentrl.cli.tools",
    "agentrl.cli.engine",
    "agentrl.cli.model",
    "agentrl.cli.train",
    "agentrl.cli.sample",
    "agentrl.cli.eval",
    "agentrl.cli.sft",
    "agentrl.cli.chat",
    "agentrl.cli.envs",
    "agentrl.cli.bench",
    "agentrl.cli.dashboard",
    "agentrl.cli.run",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or of ``command`` alone (a module named after it in ``SUBCOMMANDS``): a
    command's process then imports only its own module, not every command's options."""
    parser = argparse.ArgumentParser(
        prog="agentrl", description="AgentRL: asynchronous reinforcement learning for multi-turn tool-using LLM agents")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMANDS:
        if command is None or module_name == f"agentrl.cli.{command}":
            importlib.import_module(module_name).add_parser(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names, if it names one (its first word that is not an option)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if f"agentrl.cli.{word}" in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    setup_logging(verbose=args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
