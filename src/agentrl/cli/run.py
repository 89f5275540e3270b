"""`agentrl run`: a whole run — database, inference, tools or environment, tasks, held-out evaluations, warm-up,
samplers, trainer, live status line, summary — from one command (the example scripts call it)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from agentrl.config_flags import add_model_arguments
    from agentrl.run.config import RunConfig

    parser = sub.add_parser(
        "run", allow_abbrev=False, help="a whole run: database, engine, tools, evaluations, warm-up, RL, summary",
        description="Start what the options do not provide (an embedded database, an `agentrl engine`, the "
                    "built-in calculator or an environment server), then: held-out evaluation of the starting "
                    "model, warm-up (SFT on demonstrations) and its evaluation, RL (samplers, trainer, a live "
                    "status line), held-out evaluation of the final model and the summary (RUN_DIR/summary.json). "
                    "Every process it starts is stopped by PID when it ends, fails or is interrupted. "
                    "The example scripts' variables are named in the options' help.")
    add_model_arguments(parser, RunConfig)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    from agentrl.config_flags import model_from_namespace
    from agentrl.run.config import RunConfig
    from agentrl.run.driver import main

    return main(model_from_namespace(RunConfig, args, args._parser))
