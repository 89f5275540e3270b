"""Trainer entry point: ``python -m agentrl.train ...``, ``torchrun ... -m agentrl.train ...``,
``accelerate launch --config_file assets/accelerate/<cfg>.yml -m agentrl.train ...`` and ``agentrl train ...``.

Flags are the fields of :class:`agentrl.training.config.TrainConfig` (the original AgentRL's names where they still make
sense). Boolean flags take ``true``/``false`` (a bare ``--flag`` means true); optional numbers take ``none``.
The original's example scripts parse unchanged: its flags that mean nothing to this trainer (``ORIGINAL_FLAGS``)
are accepted with a one-line warning saying why and which command takes them, unless their value asks for
behaviour this trainer lacks (e.g. ``--pp_size 2``), which is an error naming a command that does it. Other
unknown flags are errors naming the flag. The warnings, and ``TrainConfig.advisories()``, are logged once at
start-up (on the main rank) and returned by :func:`parse_args`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from agentrl.config_flags import add_model_arguments, model_from_namespace, parse_bool
from agentrl.training.config import TrainConfig

logger = logging.getLogger("agentrl.train")


def _is_false(value: str) -> bool:
    try:
        return not parse_bool(value)
    except argparse.ArgumentTypeError:
        return False


def _is_number(expected: float) -> Callable[[str], bool]:
    def check(value: str) -> bool:
        try:
            return float(value) == expected
        except ValueError:
            return False
    return check


def _any_value(_value: str) -> bool:
    return True


@dataclass(frozen=True)
class OriginalFlag:
    """A flag of the original's trainer that means nothing to this one, accepted with a one-line warning.

    ``reason`` says why it is ignored; ``use`` is the command line (``{value}`` filled in) of the command that
    takes it, if any. Values for which ``accepts`` is false ask for behaviour this trainer lacks: they are refused
    with ``refusal`` (``{value}`` filled in), which names a command that does what they ask.
    """

    reason: str
    use: str | None = None
    accepts: Callable[[str], bool] = _any_value
    refusal: str = ""
    secret: bool = False

    def warning(self, name: str, value: str) -> str:
        shown = "***" if self.secret else value
        hint = f"; use `{self.use.format(value=shlex.quote(shown))}`" if self.use else ""
        return f"--{name} {shown}: ignored, {self.reason}{hint}"

    def error(self, name: str, value: str) -> str:
        return f"--{name} {value}: {self.refusal.format(value=shlex.quote(value))}"


_GROUP_STAGE = "advantages and group decisions are made by the samplers' group stage"
_AGENT_LOOP = "the agent loop runs in the samplers (separate processes)"
_NO_DATALOADER = ("the trainer streams its samples from the database (no DataLoader); a step takes "
                  "--train_batch_size samples")
_NO_SERVER = "the trainer starts no inference server; SGLang takes it at launch"
_EVAL = ("evaluation runs as a separate job on a checkpoint: `agentrl eval --tasks TASKS.jsonl "
         "--model_name_or_path OUTPUT_DIR/checkpoint-STEP`")

ORIGINAL_FLAGS: dict[str, OriginalFlag] = {
    **{name: OriginalFlag(_GROUP_STAGE, f"agentrl sample --{name} {{value}}")
       for name in ("adv_scaling", "drop_zero_advantage", "minimal_advantage", "scale_rewards", "leave_one_out",
                    "balance_sample", "min_turns", "efficient_rewarding", "reserve_context_error_count")},
    **{name: OriginalFlag(_AGENT_LOOP, f"agentrl sample --{name} {{value}}")
       for name in ("max_turns", "max_new_tokens", "max_prompt_tokens", "mcp_manager_url", "mcp_server_name",
                    "tool_call_parser", "max_concurrent_samples_per_process", "target_concurrency", "new_context",
                    "agent_config_path", "repetition_early_stop_times", "presence_penalty", "frequency_penalty")},
    "mcp_auth_token": OriginalFlag(_AGENT_LOOP, "agentrl sample --mcp_auth_token {value}", secret=True),
    "enable_repetition_compress": OriginalFlag(
        "a sampler option of the original; `agentrl sample` ends a repeating trajectory "
        "(--repetition_early_stop_times) and has no compression"),
    "compress_history": OriginalFlag(
        "the original had no such option either (its parser rejected it); to summarise a long context: "
        "`agentrl sample --new_context discard_all`"),
    "num_generations": OriginalFlag("the group size belongs to each Task, set when the tasks are uploaded",
                                    "agentrl tasks upload --num_generations {value} FILE"),
    "train_file": OriginalFlag("tasks are uploaded into the run's database, where the samplers claim them",
                               "agentrl tasks upload {value}"),
    "trainer": OriginalFlag("one trainer serves every Hugging Face causal LM (no per-family trainer classes)"),
    "torch_dtype": OriginalFlag("master weights stay fp32; bf16 compute is --bf16 (default on CUDA)"),
    **{name: OriginalFlag(_NO_DATALOADER)
       for name in ("dataloader_drop_last", "dataloader_num_workers", "dataloader_prefetch_factor",
                    "dataloader_pin_memory", "dataloader_persistent_workers")},
    "accelerator_config": OriginalFlag("the trainer builds no Accelerator or DataLoader: the launcher sets the "
                                       "processes, --tp_size the layout and --train_batch_size the global batch"),
    "max_trained_count": OriginalFlag(
        "every sample is trained exactly once (the only mode here)", accepts=_is_number(1),
        refusal="training a sample several times is not supported online (every sample is trained exactly "
                "once); several passes over the queued samples offline: `agentrl train --enable_sampling false "
                "--num_train_epochs {value}`"),
    "retrained_interval": OriginalFlag("it spaces the re-use of a sample, and every sample is trained once"),
    "pp_size": OriginalFlag(
        "pipeline parallelism is not supported (1 is the trainer's layout)", accepts=_is_number(1),
        refusal="pipeline parallelism is not supported; to split the model over GPUs use tensor parallelism: "
                "`agentrl train --tp_size {value}`"),
    "activation_offloading": OriginalFlag(
        "activations stay on the device, as asked", accepts=_is_false,
        refusal="activation offloading is not supported; to save activation memory recompute the activations "
                "instead: `agentrl train --gradient_checkpointing true`"),
    "eval_strategy": OriginalFlag(
        "no evaluation inside the trainer, as asked; " + _EVAL, accepts=lambda value: value.strip() == "no",
        refusal="the trainer does not evaluate; " + _EVAL),
    "eval_steps": OriginalFlag(_EVAL),
    "inf_tp_size": OriginalFlag(_NO_SERVER, "python -m sglang.launch_server --tp-size {value}"),
    "inf_ep_size": OriginalFlag(_NO_SERVER, "python -m sglang.launch_server --ep-size {value}"),
    "inf_mem_ratio": OriginalFlag(_NO_SERVER, "python -m sglang.launch_server --mem-fraction-static {value}"),
}
"""The original trainer's flags without a meaning here (its example scripts pass many of them)."""

EPILOG = ("Also accepted, for the original's scripts, each with a one-line warning saying why it is ignored and "
          "which command takes it (values asking for what this trainer does not do are errors): "
          + ", ".join(f"--{name}" for name in ORIGINAL_FLAGS) + ".")


class ParsedArgs(NamedTuple):
    config: TrainConfig
    verbose: bool
    warnings: list[str]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one flag per ``TrainConfig`` field and the ``ORIGINAL_FLAGS`` (listed in the help's epilog)."""
    add_model_arguments(parser, TrainConfig)
    for name in ORIGINAL_FLAGS:
        parser.add_argument(f"--{name}", nargs="?", const="true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.epilog = EPILOG


def build_parser(prog: str = "python -m agentrl.train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, usage="%(prog)s [--flag value ...] (all flags: --help)",
        description="Train the policy from the DBRecordData queue of a run.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_arguments(parser)
    return parser


def config_from_namespace(args: argparse.Namespace, parser: argparse.ArgumentParser
                          ) -> tuple[TrainConfig, list[str]]:
    """The ``TrainConfig`` of parsed flags and the warnings about them; a refused original flag or an invalid
    value is reported as a parser error naming the flag."""
    warnings = []
    for name, flag in ORIGINAL_FLAGS.items():
        if name in vars(args):
            value = getattr(args, name)
            if not flag.accepts(value):
                parser.error(flag.error(name, value))
            warnings.append(flag.warning(name, value))
    config = model_from_namespace(TrainConfig, args, parser)
    return config, warnings + config.advisories()


def parse_args(argv: list[str] | None = None) -> ParsedArgs:
    """``(config, verbose, warnings)`` from the command line; exits with a usage error naming any unknown flag or
    refused value. The warnings are returned, not logged (``run`` logs them)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config, warnings = config_from_namespace(args, parser)
    return ParsedArgs(config, args.verbose, warnings)


def log_warnings(warnings: Sequence[str]) -> None:
    """Log the parse-time warnings, once per launch: every rank parses the same flags, only rank 0 says so."""
    if os.environ.get("RANK", "0") == "0":
        for line in warnings:
            logger.warning("%s", line)


def run(config: TrainConfig, verbose: bool = False, warnings: Sequence[str] = ()) -> int:
    """Run one trainer rank (logging set up, ``warnings`` logged, heavy imports here); returns the exit code.

    Errors of the set-up (missing weights, a bad checkpoint, an impossible parallel layout, a missing
    ``--report_to`` package...) end the run with their message and exit code 1 instead of a traceback; a flag that
    differs from a value the run records (``RunValues``) with exit code 2, as a bad flag does.
    """
    from agentrl.log import setup_logging
    from agentrl.store.runs import RunValuesConflict
    from agentrl.training.trainer import SETUP_ERRORS, Trainer

    setup_logging(verbose=verbose)
    log_warnings(warnings)
    try:
        return Trainer(config).run()
    except RunValuesConflict as error:
        logger.error("%s", error)
        return 2
    except SETUP_ERRORS as error:
        logger.error("%s", error)
        return 1


def main(argv: list[str] | None = None) -> int:
    config, verbose, warnings = parse_args(argv)
    return run(config, verbose, warnings)


if __name__ == "__main__":
    sys.exit(main())
