"""`agentrl run`: a whole run — database, inference, tools or environment, tasks, held-out evaluations, warm-up,
samplers, trainer, live status line, summary — from one command (the example scripts call it)."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="a TOML file of options (keys: these flags without --); flags given here win over it")
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved options, each with where its value came from (flag, file, default "
                             "or derived from other options), as a file --config reads, and start nothing")
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    from agentrl.config_files import ConfigFileError, build, read_config_file, resolved_view
    from agentrl.config_flags import flag_values
    from agentrl.run.config import RunConfig

    given = flag_values(RunConfig, vars(args))
    try:
        from_file = read_config_file(args.config, RunConfig) if args.config else {}
        config = build(RunConfig, from_file, given, args.config)
    except ConfigFileError as error:
        args._parser.error(str(error))
    if args.print_config:
        print("# agentrl run: the resolved options (after each, where its value came from); --config reads this")
        print(resolved_view(config, from_file, given))
        return 0
    from agentrl.run.driver import main

    return main(config)
