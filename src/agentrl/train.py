"""Trainer entry point: ``python -m agentrl.train ...``, ``torchrun ... -m agentrl.train ...``,
``accelerate launch --config_file assets/accelerate/<cfg>.yml -m agentrl.train ...`` and ``agentrl train ...``.

Flags are the fields of :class:`agentrl.training.config.TrainConfig` (the original's names where they still make
sense). Boolean flags take ``true``/``false`` (a bare ``--flag`` means true); optional numbers take ``none``.
Unknown flags are errors naming the flag, with a hint for the original's flags that moved or no longer apply.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from agentrl.training.config import TrainConfig

MOVED_FLAGS: dict[str, str] = {
    **{name: "is a flag of `agentrl sample`: advantages and group decisions are computed in the samplers' "
             "group stage" for name in ("adv_scaling", "drop_zero_advantage", "minimal_advantage", "scale_rewards",
                                        "leave_one_out", "balance_sample", "min_turns", "efficient_rewarding",
                                        "reserve_context_error_count")},
    **{name: "is a flag of `agentrl sample` (samplers are separate processes)"
       for name in ("num_generations", "max_turns", "max_new_tokens", "max_prompt_tokens", "train_file",
                    "mcp_manager_url", "tool_call_parser", "max_concurrent_samples_per_process",
                    "target_concurrency", "new_context", "agent_config_path")},
    "cpu_ram_efficient_loading": "is not needed: pretrained weights are always loaded",
    "trainer": "is not needed: the trainer works with any Hugging Face causal LM",
    "torch_dtype": "is replaced by --bf16 (fp32 master weights; bf16 compute on CUDA)",
}

NONE_WORDS = ("none", "null")


def _bool(value: str) -> bool:
    try:
        return TypeAdapter(bool).validate_python(value.strip().lower())
    except ValidationError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}") from None


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        return None if value.strip().lower() in NONE_WORDS else convert(value)
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _add_field(parser: argparse.ArgumentParser, name: str, annotation: Any, help_text: str) -> None:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (annotation,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
    if origin is list:
        (item,) = args
        kwargs.update(nargs="+", choices=typing.get_args(item) or None)
    elif origin is typing.Literal:
        kwargs.update(choices=list(args) + ([None] if optional else []), type=_optional(str) if optional else str,
                      metavar="{" + ",".join(list(args) + (["none"] if optional else [])) + "}")
    elif annotation is bool:
        kwargs.update(type=_optional(_bool) if optional else _bool, nargs="?", const=True, metavar="true|false")
    else:
        kwargs["type"] = _optional(annotation) if optional else annotation
    parser.add_argument(f"--{name}", **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one flag per ``TrainConfig`` field on ``parser``."""
    for name, info in TrainConfig.model_fields.items():
        default = info.get_default(call_default_factory=True)
        help_text = f"{info.description or ''} (default: {default})".strip()
        _add_field(parser, name, info.annotation, help_text)


def build_parser(prog: str = "python -m agentrl.train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, usage="%(prog)s [--flag value ...] (all flags: --help)",
        description="Train the policy from the DBRecordData queue of a run.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_arguments(parser)
    return parser


def config_from_namespace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainConfig:
    """The ``TrainConfig`` of parsed flags; invalid values are reported as parser errors naming the flag."""
    values = {name: value for name, value in vars(args).items() if name in TrainConfig.model_fields}
    try:
        return TrainConfig(**values)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            where = f"--{item['loc'][0]}" if item["loc"] else "flags"
            problems.append(f"{where}: {item['msg']}")
        parser.error("; ".join(problems))


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    """``(config, verbose)`` from the command line; exits with a usage error naming any unknown flag."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [item for item in unknown if item.startswith("-")] or unknown
        hints = [f"--{flag.lstrip('-').split('=')[0]} {MOVED_FLAGS[flag.lstrip('-').split('=')[0]]}"
                 for flag in flags if flag.lstrip("-").split("=")[0] in MOVED_FLAGS]
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" + ("; " + "; ".join(hints) if hints else ""))
    return config_from_namespace(args, parser), args.verbose


def run(config: TrainConfig, verbose: bool = False) -> int:
    """Run one trainer rank (logging set up, heavy imports here); returns the exit code.

    Errors of the set-up (missing weights, a bad checkpoint, an impossible parallel layout, a missing
    ``--report_to`` package...) end the run with their message and exit code 1 instead of a traceback.
    """
    import logging

    from agentrl.log import setup_logging
    from agentrl.training.trainer import SETUP_ERRORS, Trainer

    setup_logging(verbose=verbose)
    try:
        return Trainer(config).run()
    except SETUP_ERRORS as error:
        logging.getLogger("agentrl.train").error("%s", error)
        return 1


def main(argv: list[str] | None = None) -> int:
    config, verbose = parse_args(argv)
    return run(config, verbose)


if __name__ == "__main__":
    sys.exit(main())
