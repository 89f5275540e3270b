"""`agentrl train` / `python -m agentrl.train` flags: the original AgentRL's names, true/false values, clear errors."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import typing

import pytest

from agentrl.cli.main import build_parser as build_cli_parser
from agentrl.train import ORIGINAL_FLAGS, parse_args
from agentrl.training import losses
from agentrl.training.config import TrainConfig
from agentrl.training.loss_config import LossConfig, LossName

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fails(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_original_flag_names_and_values_parse() -> None:
    config, verbose, warnings = parse_args([
        "--model_name_or_path", "m", "--db_connection_string", "mongodb://h/run", "--loss_calculater", "MINIRL",
        "--strict_in_bound", "true", "--token_level_loss", "false", "--skip_length_normalization", "True",
        "--bf16", "--importance_weight_cap_ratio", "none", "--epsilon_higher", "0.28", "--report_to", "tensorboard",
        "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "48", "--lr_scheduler_type",
        "cosine", "--max_steps", "1000", "--warmup_steps", "10", "--max_grad_norm", "1.0", "--save_steps", "3",
        "--resume_from_checkpoint", "latest", "--enable_sampling", "false", "--sync_every", "2", "--seed", "42"])
    assert not verbose and warnings == []
    loss = config.loss
    assert (loss.loss_calculater, loss.strict_in_bound, loss.token_level_loss) == ("MINIRL", True, False)
    assert loss.skip_length_normalization and config.bf16 is True
    assert loss.importance_weight_cap_ratio is None and loss.epsilon_higher == 0.28
    assert config.report_to == ["tensorboard"] and config.sync_every == 2 and not config.enable_sampling
    # the global batch: per-device × accumulation × data-parallel ranks, unless given directly
    assert config.resolved_train_batch_size(dp_size=2) == 96
    assert TrainConfig(train_batch_size=32).resolved_train_batch_size(dp_size=4) == 32
    with pytest.raises(ValueError, match="smaller than the data-parallel size"):
        TrainConfig(train_batch_size=2).resolved_train_batch_size(dp_size=4)


def test_every_loss_name_is_a_registered_loss() -> None:
    assert set(typing.get_args(LossName)) == set(losses.LOSSES)


LOSS_FLAG_DEFAULTS = {
    "loss_calculater": "GRPO", "epsilon": 0.2, "epsilon_higher": 0.1, "strict_in_bound": False,
    "out_of_date_decay": None, "importance_weight_cap_ratio": 4.0, "truncated_is_cap": None,
    "token_level_loss": True, "skip_length_normalization": False, "kl_coef": 0.0,
}
"""The original's loss flags and their defaults, which users' scripts rely on."""
OUR_LOSS_FLAG_DEFAULTS = {"trajectory_weight": "turns"}
"""Loss flags the original did not have, and their defaults (the original's behaviour)."""


def test_loss_flags_keep_their_names_and_defaults() -> None:
    config = parse_args([]).config
    assert config.loss.model_dump() == LOSS_FLAG_DEFAULTS | OUR_LOSS_FLAG_DEFAULTS
    snapshot = config.flag_values(exclude=frozenset({"db_connection_string"}))  # the run's snapshot: flat flags
    assert {name: snapshot[name] for name in LOSS_FLAG_DEFAULTS} == LOSS_FLAG_DEFAULTS
    assert "loss" not in snapshot and "db_connection_string" not in snapshot and snapshot["max_steps"] == -1
    given = parse_args(["--loss_calculater", "GSPO", "--epsilon", "0.1", "--epsilon_higher", "0.2",
                        "--strict_in_bound", "--out_of_date_decay", "0.5", "--importance_weight_cap_ratio", "2",
                        "--truncated_is_cap", "3", "--token_level_loss", "false", "--skip_length_normalization",
                        "false", "--kl_coef", "0.01"]).config
    assert given.loss == LossConfig(
        loss_calculater="GSPO", epsilon=0.1, epsilon_higher=0.2, strict_in_bound=True, out_of_date_decay=0.5,
        importance_weight_cap_ratio=2.0, truncated_is_cap=3.0, token_level_loss=False,
        skip_length_normalization=False, kl_coef=0.01)
    assert TrainConfig(**given.model_dump()) == given


def test_loss_options_are_checked_when_parsed(capsys: pytest.CaptureFixture) -> None:
    error = _fails(["--out_of_date_decay", "0.1", "--importance_weight_cap_ratio", "none"], capsys)
    assert "out_of_date_decay needs a band" in error
    assert "--kl_coef: Input should be greater than or equal to 0" in _fails(["--kl_coef", "-1"], capsys)


def test_cross_entropy_warns_about_the_ratio_flags_it_ignores() -> None:
    [line] = parse_args(["--loss_calculater", "CrossEntropy", "--epsilon", "0.3", "--out_of_date_decay", "0.1",
                         "--kl_coef", "0.1"]).warnings
    assert "--loss_calculater CrossEntropy" in line and "--epsilon 0.3, --out_of_date_decay 0.1 ignored" in line


def test_errors_name_the_flag(capsys: pytest.CaptureFixture) -> None:
    assert "unrecognized arguments: --no_such_flag" in _fails(["--no_such_flag", "1"], capsys)
    assert "unrecognized arguments: --max_step 3" in _fails(["--max_step", "3"], capsys)  # no prefix matching
    assert "--strict_in_bound: expected true or false, got 'maybe'" in _fails(["--strict_in_bound", "maybe"], capsys)
    assert "--epsilon: Input should be less than 1" in _fails(["--epsilon", "1.5"], capsys)
    assert "--lr_scheduler_type cosine decays over --max_steps" in _fails(["--lr_scheduler_type", "cosine"], capsys)
    assert "contradicts --max_staleness 2" in _fails(["--sync_sampling", "true", "--max_staleness", "2"], capsys)
    assert "invalid choice: 'PPO'" in _fails(["--loss_calculater", "PPO"], capsys)


@pytest.mark.parametrize("command", [[sys.executable, "-m", "agentrl.train"],
                                     [sys.executable, "-m", "agentrl.cli.main", "train"]])
def test_both_entry_points_reject_unknown_flags(command: list[str]) -> None:
    result = subprocess.run([*command, "--bogus_flag", "x"], check=False, capture_output=True, text=True,
                            timeout=60, env=ENV)
    assert result.returncode == 2 and "unrecognized arguments: --bogus_flag" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------- the original's example scripts (§5.2)

PSP = '{"temperature": 1, "top_p": 1, "min_p": 0, "top_k": -1}'
COMMON = [
    "--model_name_or_path", "tests/model", "--trainer", "QwenTrainer",
    "--db_connection_string", "mongodb://127.0.0.1:27017/test_run?replicaSet=rs0",
    "--cpu_ram_efficient_loading", "true", "--weight_decay", "0.05", "--optim_args", "beta1=0.9,beta2=0.98",
    "--adv_scaling", "2.0", "--max_tokens", "131072", "--max_trained_count", "1", "--train_file", "tests/tasks.jsonl",
    "--dataloader_drop_last", "true", "--dataloader_num_workers", "1", "--dataloader_prefetch_factor", "4",
    "--max_grad_norm", "1.0", "--logging_steps", "1", "--learning_rate", "2e-6", "--lr_scheduler_type", "cosine",
    "--bf16", "--tp_size", "4", "--pp_size", "1", "--activation_offloading", "false",
    "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "48", "--seed", "42",
    "--eval_strategy", "no", "--eval_steps", "5", "--run_name", "test_run", "--report_to", "swanlab",
    "--save_steps", "3", "--accelerator_config", '{"split_batches":true}', "--pad_to_multiple_of", "4096",
    "--enable_sampling", "true", "--agent_config_path", "tests/agent_config.yml",
    "--mcp_manager_url", "http://127.0.0.1:9700/mcpapi", "--max_new_tokens", "32768",
    "--max_prompt_tokens", "128768", "--num_generations", "8", "--tool_call_parser", "qwen",
    "--preferred_sampling_params", PSP, "--presence_penalty", "0.0", "--frequency_penalty", "0.0",
    "--inf_tp_size", "1", "--inf_mem_ratio", "0.8", "--max_concurrent_samples_per_process", "4",
    "--target_concurrency", "3", "--repetition_early_stop_times", "4", "--enable_repetition_compress", "false",
    "--output_dir", "tests/output/test_run"]
MINIRL_SCRIPT = [
    *COMMON, "--loss_calculater", "MINIRL", "--token_level_loss", "false", "--strict_in_bound", "true",
    "--skip_length_normalization", "true", "--max_steps", "1000", "--num_train_epochs", "3", "--warmup_steps", "10",
    "--save_only_model", "false", "--balance_sample", "false", "--max_turns", "100", "--compress_history", "false"]
GRPO_SCRIPT = [
    *COMMON, "--loss_calculater", "GRPO", "--token_level_loss", "true", "--max_steps", "1000",
    "--num_train_epochs", "5", "--warmup_steps", "5", "--save_only_model", "true", "--balance_sample", "true",
    "--max_turns", "200"]
IGNORED = {  # flags of the scripts without a meaning for the trainer: one warning line each
    "trainer", "adv_scaling", "max_trained_count", "train_file", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_prefetch_factor", "pp_size", "activation_offloading", "eval_strategy", "eval_steps",
    "accelerator_config", "agent_config_path", "mcp_manager_url", "max_new_tokens", "max_prompt_tokens",
    "num_generations", "tool_call_parser", "presence_penalty", "frequency_penalty", "inf_tp_size", "inf_mem_ratio",
    "max_concurrent_samples_per_process", "target_concurrency", "repetition_early_stop_times",
    "enable_repetition_compress", "balance_sample", "max_turns"}
# flags of the original's trainer outside the two scripts, with a value each (every ORIGINAL_FLAGS entry is tried)
OTHER_ORIGINAL = ["--scale_rewards", "true", "--leave_one_out", "true", "--drop_zero_advantage", "false",
                  "--minimal_advantage", "0.1", "--min_turns", "1", "--efficient_rewarding", "true",
                  "--reserve_context_error_count", "2", "--new_context", "discard_all", "--mcp_server_name", "all",
                  "--mcp_auth_token", "secret", "--torch_dtype", "bfloat16", "--retrained_interval", "1",
                  "--inf_ep_size", "1", "--dataloader_pin_memory", "true",
                  "--dataloader_persistent_workers", "false"]


def _flags(argv: list[str]) -> set[str]:
    return {item[2:] for item in argv if item.startswith("--")}


def _lines_about(warnings: list[str], flag: str) -> list[str]:
    return [line for line in warnings if re.match(rf"--{flag}\b(?!_)", line)]


def _commands(text: str) -> list[str]:
    return re.findall(r"`(agentrl [^`]*)`", text)


def _accepted_by_its_parser(command: str) -> None:
    """The hinted command line parses with that command's own argparse parser."""
    try:
        build_cli_parser().parse_args(shlex.split(command)[1:])
    except SystemExit as error:
        raise AssertionError(f"the hint `{command}` is refused by its own parser") from error


def test_minirl_example_flags_parse_unchanged() -> None:
    parsed = parse_args(MINIRL_SCRIPT)
    c = parsed.config
    assert (c.loss.loss_calculater, c.loss.token_level_loss, c.loss.strict_in_bound,
            c.loss.skip_length_normalization) == ("MINIRL", False, True, True)
    assert (c.adam_beta1, c.adam_beta2, c.adam_epsilon, c.weight_decay) == (0.9, 0.98, 1e-8, 0.05)
    assert (c.learning_rate, c.lr_scheduler_type, c.warmup_steps, c.max_steps, c.max_grad_norm) == (
        2e-6, "cosine", 10, 1000, 1.0)
    assert c.bf16 is True and c.tp_size == 4 and c.cpu_ram_efficient_loading and not c.save_only_model
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.max_tokens, c.pad_to_multiple_of) == (
        1, 48, 131072, 4096)
    assert c.temperature == 1.0 and c.report_to == ["swanlab"] and c.save_steps == 3 and c.enable_sampling
    for flag in IGNORED | {"compress_history"}:
        assert len(_lines_about(parsed.warnings, flag)) == 1, (flag, parsed.warnings)
    assert not any("MINIRL" in line for line in parsed.warnings)  # the recommended recipe


def test_grpo_example_flags_parse_unchanged() -> None:
    parsed = parse_args(GRPO_SCRIPT)
    c = parsed.config
    assert (c.loss.loss_calculater, c.loss.token_level_loss, c.loss.strict_in_bound,
            c.loss.skip_length_normalization) == ("GRPO", True, False, False)
    assert (c.adam_beta1, c.adam_beta2, c.weight_decay, c.learning_rate, c.warmup_steps) == (
        0.9, 0.98, 0.05, 2e-6, 5)
    assert c.save_only_model and c.bf16 is True and c.tp_size == 4 and c.num_train_epochs == 5
    for flag in IGNORED:
        assert len(_lines_about(parsed.warnings, flag)) == 1, (flag, parsed.warnings)
    assert not any("GRPO" in line for line in parsed.warnings)


def test_warnings_are_one_line_each_and_only_for_what_the_trainer_does_not_do() -> None:
    parsed = parse_args(MINIRL_SCRIPT)
    assert all("\n" not in line for line in parsed.warnings)
    flagged = {re.match(r"--(\w+)", line).group(1) for line in parsed.warnings}
    # beyond the ignored flags: unsupported report_to values, the sampling parameters the trainer does not use,
    # and sampling epochs (the original pushed the task set num_train_epochs times)
    assert flagged == IGNORED | {"compress_history", "report_to", "preferred_sampling_params", "num_train_epochs"}
    [report] = _lines_about(parsed.warnings, "report_to")
    assert "swanlab" in report and "not supported" in report and "database" in report
    assert parse_args(["--report_to", "tensorboard", "wandb"]).warnings == []
    assert parse_args(["--report_to", "none"]).config.report_to == ["none"]


def test_every_hint_names_a_command_whose_parser_accepts_it() -> None:
    argv = [*MINIRL_SCRIPT, *OTHER_ORIGINAL]
    assert set(ORIGINAL_FLAGS) <= _flags(argv) | _flags(GRPO_SCRIPT), "every original flag is tried"
    hints = [command for script in (argv, GRPO_SCRIPT) for line in parse_args(script).warnings
             for command in _commands(line)]
    assert "agentrl tasks upload --num_generations 8 FILE" in hints
    assert "agentrl tasks upload tests/tasks.jsonl" in hints
    assert "agentrl sample --max_turns 100" in hints and "agentrl sample --adv_scaling 2.0" in hints
    for command in hints:
        _accepted_by_its_parser(command)


@pytest.mark.parametrize("argv, flag", [
    (["--pp_size", "2"], "pp_size"), (["--max_trained_count", "2"], "max_trained_count"),
    (["--activation_offloading", "true"], "activation_offloading"),
    (["--activation_offloading"], "activation_offloading"),
    (["--eval_strategy", "steps"], "eval_strategy")])
def test_contradictory_values_are_refused_with_a_working_hint(argv: list[str], flag: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    error = _fails(argv, capsys)
    assert f"--{flag} {argv[1] if len(argv) > 1 else 'true'}" in error, error
    [command] = _commands(error)
    _accepted_by_its_parser(command)


def test_optim_args_map_onto_the_adam_flags(capsys: pytest.CaptureFixture) -> None:
    config = parse_args(["--optim_args", "beta1=0.8, beta2=0.95,eps=1e-6"]).config
    assert (config.adam_beta1, config.adam_beta2, config.adam_epsilon) == (0.8, 0.95, 1e-6)
    # agreeing explicit values are fine, and the snapshot validates again as it is
    config = parse_args(["--optim_args", "beta2=0.98", "--adam_beta2", "0.98"]).config
    assert TrainConfig(**config.model_dump()) == config
    error = _fails(["--optim_args", "beta2=0.98", "--adam_beta2", "0.999"], capsys)
    assert "--optim_args beta2=0.98 contradicts --adam_beta2 0.999" in error
    error = _fails(["--optim_args", "beta1=0.9,momentum=0.5"], capsys)
    assert "--optim_args: unknown key 'momentum'" in error and "beta1, beta2, eps" in error
    assert "--optim_args: expected key=value" in _fails(["--optim_args", "beta1"], capsys)
    assert "--optim_args beta1=x" in _fails(["--optim_args", "beta1=x"], capsys)


def test_preferred_sampling_params_give_the_behaviour_temperature(capsys: pytest.CaptureFixture) -> None:
    parsed = parse_args(["--preferred_sampling_params", '{"temperature": 0.7}'])
    assert parsed.config.temperature == 0.7 and parsed.warnings == []
    assert parse_args(["--preferred_sampling_params", '{"temperature": 0.7}', "--temperature", "0.7"]).config
    error = _fails(["--preferred_sampling_params", '{"temperature": 0.7}', "--temperature", "1.0"], capsys)
    assert "--preferred_sampling_params temperature 0.7 contradicts --temperature 1.0" in error
    assert "--preferred_sampling_params: expected a JSON object" in _fails(["--preferred_sampling_params", "t=1"],
                                                                           capsys)
    [line] = parse_args(["--preferred_sampling_params", '{"top_p": 0.9}']).warnings
    assert line.startswith("--preferred_sampling_params") and "top_p" in line
    for command in _commands(line):
        _accepted_by_its_parser(command)


@pytest.mark.parametrize("argv, words", [
    (["--loss_calculater", "GSPO", "--token_level_loss", "true"], ["GSPO", "--token_level_loss", "sequence"]),
    (["--loss_calculater", "MINIRL"], ["MINIRL", "--strict_in_bound true", "--token_level_loss false"]),
    (["--loss_calculater", "MINIRL", "--token_level_loss", "false", "--skip_length_normalization", "true"],
     ["MINIRL", "--strict_in_bound true"]),
    (["--loss_calculater", "GRPO", "--token_level_loss", "false"], ["GRPO", "--token_level_loss true"])])
def test_recipes_against_their_authors_advice_warn_once(argv: list[str], words: list[str]) -> None:
    [line] = parse_args(argv).warnings
    assert all(word in line for word in words), line


def test_recommended_recipes_do_not_warn() -> None:
    for argv in (["--loss_calculater", "GSPO"], ["--loss_calculater", "GSPO", "--token_level_loss", "false"],
                 ["--loss_calculater", "GRPO"], ["--loss_calculater", "CrossEntropy", "--token_level_loss", "false"],
                 ["--loss_calculater", "MINIRL", "--token_level_loss", "false", "--strict_in_bound", "true",
                  "--skip_length_normalization", "true"]):
        assert parse_args(argv).warnings == [], argv


def test_help_lists_the_accepted_original_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--optim_args" in out and "--save_only_model" in out and "--preferred_sampling_params" in out
    assert "--num_generations" in out and "--dataloader_num_workers" in out  # in the epilog


@pytest.mark.parametrize("command", [[sys.executable, "-m", "agentrl.train"],
                                     [sys.executable, "-m", "agentrl.cli.main", "train"]])
def test_both_entry_points_warn_once_on_stderr(command: list[str]) -> None:
    # --tp_size 2 in a single process ends the run right after parsing, before any database
    result = subprocess.run([*command, "--max_turns", "100", "--tp_size", "2"], check=False, capture_output=True,
                            text=True, timeout=120, env=ENV)
    assert result.returncode == 1 and "--tp_size 2 needs 2 processes" in result.stderr, result.stderr
    assert result.stderr.count("--max_turns 100: ") == 1 and "`agentrl sample --max_turns 100`" in result.stderr
    assert "Traceback" not in result.stderr
