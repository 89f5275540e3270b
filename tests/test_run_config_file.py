"""`agentrl run`'s configuration tree: ``--preset``, ``--config FILE``, dotted section flags and ``--print_config``
(the resolved options with where each came from; a file ``--config`` reads back), through the real command line
in this process (nothing is started)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from agentrl.cli.main import main
from agentrl.config_flags import flag_fields
from agentrl.run.config import SECTIONS, SHARED, WIRED, RunConfig


def printed(capsys: pytest.CaptureFixture, *argv: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """``agentrl run ARGV --print_config``: its text, and ``[section.]key`` -> (value as printed, origin)."""
    assert main(["run", *argv, "--print_config"]) == 0
    text, options, section = capsys.readouterr().out, {}, ""
    for line in text.splitlines()[1:]:
        if line.startswith("["):
            section = line[1:line.index("]")] + "."
        elif line:
            setting, _, origin = line.removeprefix("# ").partition("  # ")
            key, _, value = setting.partition(" = ")
            assert section + key not in options, f"{section + key} shown twice"
            options[section + key] = (value, origin)
    return text, options


def test_the_defaults_show_every_value_once_with_its_origin(capsys: pytest.CaptureFixture) -> None:
    _, options = printed(capsys, "--run_name", "r")
    run_options = [name for name in RunConfig.model_fields if name not in SECTIONS]
    assert [key for key in options if "." not in key] == run_options
    for section, model in SECTIONS.items():  # every flag of each process, less those the run sets or shares
        shared = {flag for targets in SHARED["rl"].values() for at, flag in targets if at == section}
        assert {key.partition(".")[2] for key in options if key.startswith(section + ".")} == \
            set(flag_fields(model)) - WIRED[section] - shared
    assert options["run_name"] == ('"r"', "flag") and options["model"] == ("(unset)", "default")
    assert options["temperature"] == ("1.0", "default (to sampler.temperature, trainer.temperature)")
    assert options["trainer.learning_rate"] == ("1e-06", "default, --learning_rate")
    assert options["scorer"] == ('"math_format"', "derived")


def test_a_preset_and_its_tables_then_a_file_then_flags(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _, options = printed(capsys, "--preset", "cpu-demo", "--env", "textcraft", "--lora_r", "8")
    assert options["max_turns"][0] == "12" and options["max_turns"][1].startswith("preset")  # [with_env]
    assert options["trainer.learning_rate"] == ("5e-05", "preset, --learning_rate")  # [with_lora]
    assert options["warmup_trainer.learning_rate"] == ("0.002", "preset, --warmup_learning_rate")  # env + lora
    config = tmp_path / "run.toml"
    config.write_text('run_name = "from-file"\ntrain_steps = 5\nmax_turns = 3\n[trainer]\nweight_decay = 0.1\n'
                      '[with_env]\nnum_generations = 6\n')
    _, options = printed(capsys, "--preset", "cpu-demo", "--config", str(config), "--train_steps", "7",
                         "--trainer.adam_beta2", "0.95")
    assert options["run_name"] == ('"from-file"', "file")
    assert options["trainer.max_steps"] == ("7", "flag, --train_steps")
    assert options["max_turns"][:1] == ("3",) and options["trainer.weight_decay"] == ("0.1", "file")
    assert options["trainer.adam_beta2"] == ("0.95", "flag")
    assert options["num_generations"] == ("4", "default")  # the file's [with_env] table: no --env, not applied
    assert options["trainer.learning_rate"] == ("2e-06", "preset, --learning_rate")


def test_the_view_reads_back_as_the_same_configuration(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    argv = ("--preset", "cpu-demo", "--env", "babyai", "--run_name", "r", "--sampler.top_k", "5",
            "--sampler.allow_biased_sampling", "--eval.max_attempts", "2")
    text, options = printed(capsys, *argv)
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(text)
    assert tomllib.loads(text)["sampler"]["top_k"] == 5
    _, again = printed(capsys, "--config", str(dumped))
    assert {key: value for key, (value, _) in again.items()} == {key: value for key, (value, _) in options.items()}
    assert {origin.split(",")[0].split(" (")[0] for value, origin in again.values() if value != "(unset)"} <= {
        "file", "--loss_flags"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--sampler.temperature", "0.5"], "--sampler.temperature: a value several processes share: set --temperature"),
    (["--trainer.output_dir", "x"], "--trainer.output_dir: the run sets it"),
    (["--trainer.learning_rate", "fast"], "argument --trainer.learning_rate: invalid float value"),
    (["--trainer.nope", "1"], "unrecognized arguments: --trainer.nope"),
    (["--preset", "gpu-giant"], "--preset gpu-giant: no such preset (presets: cpu-demo, cpu-eval"),
    (["--sampler.top_p", "0.9"], "top_p 0.9 on the train split"),
    (["--learning_rate", "0"], "--learning_rate: Input should be greater than 0"),
    (["--preset", "cpu-demo", "--trainer.sync_sampling", "true"],  # the preset's max_staleness 2, pushed down
     "--sync_sampling trains only on current-version samples: it contradicts --max_staleness 2"),
    (["--trainer.learning_rate", "0"], "--trainer.learning_rate: Input should be greater than 0"),
])
def test_bad_section_flags_are_usage_errors_naming_them(capsys: pytest.CaptureFixture, argv: list[str],
                                                         message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", *argv, "--print_config"])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("text", "message"), [
    ("learning_rat = 1\n", "run.toml: learning_rat: no option named learning_rat"),
    ('learning_rate = "fast"\n', "run.toml: learning_rate: Input should be a valid number"),
    ('[trainer]\nlearning_rate = "fast"\n', "run.toml: [trainer] learning_rate: Input should be a valid number"),
    ("[trainer]\nlr = 1\n", "run.toml: [trainer] lr: not a flag of this process"),
    ("[with_gpu]\nlr = 1\n", "run.toml: with_gpu: expected a table [with_env], [with_lora] or [with_model]"),
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
