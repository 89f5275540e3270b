"""`agentrl run --config FILE` and `--print_config`: options from a TOML file, flags winning over it, and the
resolved options with where each came from (the real command line, in this process; nothing is started)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from agentrl.cli.main import main
from agentrl.run.config import RunConfig


def resolved(capsys: pytest.CaptureFixture, *argv: str) -> dict[str, tuple[str, str]]:
    """``agentrl run ARGV --print_config`` as option -> (value as printed, origin)."""
    assert main(["run", *argv, "--print_config"]) == 0
    options = {}
    for line in capsys.readouterr().out.splitlines()[1:]:
        setting, _, origin = line.removeprefix("# ").rpartition("  # ")
        key, _, value = setting.partition(" = ")
        options[key] = (value, origin)
    return options


def test_the_defaults_show_every_option_once_with_its_origin(capsys: pytest.CaptureFixture) -> None:
    options = resolved(capsys, "--run_name", "r")
    assert list(options) == list(RunConfig.model_fields)
    assert options["run_name"] == ('"r"', "flag")
    assert options["train_steps"] == ("32", "default") and options["model"] == ("(unset)", "default")
    assert options["learning_rate"] == ("2e-06", "derived") and options["warmup"] == ("24", "derived")


def test_a_file_sets_options_flags_win_and_the_view_reads_back(capsys: pytest.CaptureFixture,
                                                                tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('run_name = "from-file"\nlora_r = 8\ntrain_steps = 5\nenv = "textcraft"\n')
    options = resolved(capsys, "--config", str(config), "--train_steps", "7")
    assert options["run_name"] == ('"from-file"', "file") and options["train_steps"] == ("7", "flag")
    assert options["learning_rate"] == ("5e-05", "derived")  # LoRA's rate, from the file's lora_r
    assert options["max_turns"] == ("12", "derived")  # --env's longer rollouts
    # The view is a file --config reads: the same options again, now from the file.
    dumped = tmp_path / "dumped.toml"
    assert main(["run", "--config", str(config), "--train_steps", "7", "--print_config"]) == 0
    dumped.write_text(capsys.readouterr().out)
    again = resolved(capsys, "--config", str(dumped))
    assert {key: value for key, (value, _) in again.items()} == {key: value for key, (value, _) in options.items()}
    assert {origin for value, origin in again.values() if value != "(unset)"} == {"file"}
    assert tomllib.loads(dumped.read_text())["train_steps"] == 7


@pytest.mark.parametrize(("text", "message"), [
    ("learning_rat = 1\n", "run.toml: no option named learning_rat"),
    ('learning_rate = "fast"\n', "run.toml: learning_rate: Input should be a valid number"),
    ("train_steps = [\n", "run.toml: not valid TOML"),
])
def test_a_bad_file_is_a_usage_error_naming_the_file_and_key(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                              text: str, message: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", str(config), "--print_config"])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_file_is_a_usage_error(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", str(tmp_path / "none.toml"), "--print_config"])
    assert exited.value.code == 2 and "none.toml: cannot read it" in capsys.readouterr().err
