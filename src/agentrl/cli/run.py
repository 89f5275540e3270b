"""`agentrl run`: a whole run — database, inference, tools or environment, tasks, held-out evaluations, warm-up,
samplers, trainer, live status line, summary — from one command (the example scripts call it)."""

from __future__ import annotations

import argparse
from pathlib import Path

SECTIONS_HELP = (
    "Sections: every flag of the processes the run starts is an option too, as --SECTION.FLAG: --sampler.FLAG "
    "(`agentrl sample`), --trainer.FLAG (`agentrl train`), --warmup_trainer.FLAG (the warm-up's `agentrl train`), "
    "--eval.FLAG (`agentrl eval`, every evaluation of the run), --engine.FLAG (`agentrl engine`, the engines the run "
    "and its evaluations start), e.g. --trainer.weight_decay 0.1; in a --config file "
    "the key of a [SECTION] table. --print_config shows them all with their values.")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from agentrl.config_flags import add_flag, add_model_arguments, flag_fields
    from agentrl.run.config import SECTIONS, SHORT_NAMES, RunConfig

    parser = sub.add_parser(
        "run", allow_abbrev=False, help="a whole run: database, engine, tools, evaluations, warm-up, RL, summary",
        description="Start what the options do not provide (an embedded database, an `agentrl engine`, the "
                    "built-in calculator or an environment server), then: held-out evaluation of the starting "
                    "model, warm-up (SFT on demonstrations) and its evaluation, RL (samplers, trainer, a live "
                    "status line), held-out evaluation of the final model and the summary (RUN_DIR/summary.json). "
                    "Every process it starts is stopped by PID when it ends, fails or is interrupted. "
                    "The example scripts name the preset cpu-demo and give each variable as the option of its name "
                    "in lower case.", epilog=SECTIONS_HELP)
    parser.add_argument("--preset", default=None, metavar="NAME",
                        help="options of configs/NAME.toml (cpu-demo: the CPU demo of minirl_example.sh; cpu-eval: "
                             "eval_example.sh's), under a --config file's and the flags")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="a TOML file of options (keys: these flags without --, [SECTION] tables); flags given "
                             "here win over it")
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved options, each with where its value came from (flag, file, preset, "
                             "default or derived from other options), as a file --config reads, and start nothing")
    add_model_arguments(parser, RunConfig)
    short = parser.add_argument_group("short names of section flags (the example scripts' variables)")
    for name, (section, flag) in SHORT_NAMES.items():
        info = flag_fields(SECTIONS[section])[flag]
        add_flag(short, name, info, help=f"--{section}.{flag}: {info.description or ''}".rstrip(": "), aliases=False)
    for section, model in SECTIONS.items():
        add_model_arguments(parser, model, prefix=f"{section}.", hidden=True)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    from agentrl.config_files import ConfigFileError
    from agentrl.run.layers import command_line_flags, resolve, view

    try:
        resolved = resolve(command_line_flags(args), args.preset, args.config)
    except ConfigFileError as error:
        args._parser.error(str(error))
    if args.print_config:
        print(view(resolved))
        return 0
    from agentrl.run.driver import main

    return main(resolved.config)
