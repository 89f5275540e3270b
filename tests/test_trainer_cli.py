"""`agentrl train` / `python -m agentrl.train` flags: the original's names, true/false values, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest

from agentrl.train import parse_args
from agentrl.training import losses
from agentrl.training.config import LossName, TrainConfig

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _fails(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_original_flag_names_and_values_parse() -> None:
    config, verbose = parse_args([
        "--model_name_or_path", "m", "--db_connection_string", "mongodb://h/run", "--loss_calculater", "MINIRL",
        "--strict_in_bound", "true", "--token_level_loss", "false", "--skip_length_normalization", "True",
        "--bf16", "--importance_weight_cap_ratio", "none", "--epsilon_higher", "0.28", "--report_to", "tensorboard",
        "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "48", "--lr_scheduler_type",
        "cosine", "--max_steps", "1000", "--warmup_steps", "10", "--max_grad_norm", "1.0", "--save_steps", "3",
        "--resume_from_checkpoint", "latest", "--enable_sampling", "false", "--sync_every", "2", "--seed", "42"])
    assert not verbose
    assert (config.loss_calculater, config.strict_in_bound, config.token_level_loss) == ("MINIRL", True, False)
    assert config.skip_length_normalization and config.bf16 is True
    assert config.importance_weight_cap_ratio is None and config.epsilon_higher == 0.28
    assert config.report_to == ["tensorboard"] and config.sync_every == 2 and not config.enable_sampling
    # the global batch: per-device × accumulation × data-parallel ranks, unless given directly
    assert config.resolved_train_batch_size(dp_size=2) == 96
    assert TrainConfig(train_batch_size=32).resolved_train_batch_size(dp_size=4) == 32
    with pytest.raises(ValueError, match="smaller than the data-parallel size"):
        TrainConfig(train_batch_size=2).resolved_train_batch_size(dp_size=4)
    assert config.loss_config().strict_in_bound  # a valid LossConfig of the losses module


def test_loss_names_match_the_losses_module() -> None:
    assert typing.get_args(LossName) == typing.get_args(losses.LossName)


def test_errors_name_the_flag(capsys: pytest.CaptureFixture) -> None:
    assert "unrecognized arguments: --no_such_flag" in _fails(["--no_such_flag", "1"], capsys)
    error = _fails(["--adv_scaling", "2"], capsys)
    assert "--adv_scaling is a flag of `agentrl sample`" in error
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
