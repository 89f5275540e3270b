"""`agentrl train`: the trainer (the same flags and code as ``python -m agentrl.train``)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from agentrl.train import add_arguments

    parser = sub.add_parser(
        "train", allow_abbrev=False, usage="%(prog)s [--flag value ...] (all flags: --help)",
        help="train the policy from the run's DBRecordData queue",
        description="Stream the run's DBRecordData, optimise GRPO / MINIRL / GSPO / CrossEntropy, publish weights "
                    "to the inference services and checkpoint. For several processes use torchrun or accelerate "
                    "launch with -m agentrl.train and the same flags.")
    add_arguments(parser)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    from agentrl.train import config_from_namespace
    from agentrl.train import run as run_trainer

    config, warnings = config_from_namespace(args, args._parser)
    return run_trainer(config, verbose=args.verbose, warnings=warnings)
