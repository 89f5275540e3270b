"""`agentrl run`'s options are one tree with one default per value: a run option that names a flag of a process it
starts is either a value several processes share (its default: None, the component's) or one the run wires into
that process itself (the process's section may not set it); the short names, shared values and wired flags all
name real flags; the values every sampler and trainer must agree on have the defaults of ``RunValues``; every
preset resolves under each of its tables' conditions."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agentrl.config_flags import flag_fields
from agentrl.rollout.config import SamplerConfig
from agentrl.run.config import PRESETS, SECTIONS, SHARED, SHORT_NAMES, TASK_SETS, WIRED, RunConfig
from agentrl.run.layers import resolve
from agentrl.store.models import RunValues
from agentrl.training.config import TrainConfig


def test_no_run_option_redeclares_a_flag_of_a_process() -> None:
    shared = {name for values in SHARED.values() for name in values}
    for name, info in RunConfig.model_fields.items():
        if name in SECTIONS:
            continue
        for section, model in SECTIONS.items():
            if name not in flag_fields(model):
                continue
            if name in shared:
                assert info.default is None, f"--{name}: a shared value's default is its component's"
            else:
                assert name in WIRED[section], f"--{name} is also --{section}.{name} with a default of its own"


def test_shared_short_and_wired_names_are_real_flags() -> None:
    for mode, values in SHARED.items():
        for name, targets in values.items():
            assert RunConfig.model_fields[name].default is None, name
            for section, flag in targets:
                assert flag in flag_fields(SECTIONS[section]), (mode, name, section, flag)
                assert flag not in WIRED[section], (mode, name, section, flag)
    for name, (section, flag) in SHORT_NAMES.items():
        assert flag in flag_fields(SECTIONS[section]) and flag not in WIRED[section], name
        assert name not in RunConfig.model_fields, f"--{name} is both a run option and a short name"
        assert all(flag != target for targets in SHARED["rl"].values() for at, target in targets if at == section)
    for section, flags in WIRED.items():
        assert flags <= set(flag_fields(SECTIONS[section])), flags - set(flag_fields(SECTIONS[section]))


@pytest.mark.parametrize("name", ["temperature", "train_batch_size", "max_staleness"])
def test_the_run_values_have_one_default(name: str) -> None:
    default = RunValues.model_fields[name].default
    assert flag_fields(SamplerConfig)[name].default == default
    trainer = flag_fields(TrainConfig)[name].default
    assert trainer in (default, None), f"the trainer's {name} default {trainer} is not RunValues' {default}"


@pytest.mark.parametrize("preset", sorted(path.stem for path in PRESETS.glob("*.toml")))
def test_every_preset_resolves_under_each_condition(preset: str) -> None:
    mode = "eval" if "eval" in preset else "rl"
    for env, lora_r, model in itertools.product((None, "textcraft", "sciworld"), (0, 8), (None, "/m")):
        flags = {"mode": mode, "env": env, "lora_r": lora_r, "model": model, "run_name": "r"}
        config = resolve({key: value for key, value in flags.items() if value is not None}, preset).config
        assert config.run_name == "r"


def test_a_presets_relative_paths_are_the_repositorys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the repository: a preset's paths do not depend on where the run starts
    config = resolve({}, "cpu-vision-demo").config
    assert (config.tasks, config.eval_tasks, config.warmup_tasks) == tuple(
        TASK_SETS / f"pictures_{name}.jsonl" for name in ("rl", "heldout", "warmup"))
    assert all(path.is_file() for path in (config.tasks, config.eval_tasks, config.warmup_tasks))
    assert resolve({"tasks": "mine.jsonl"}, "cpu-vision-demo").config.tasks == Path("mine.jsonl")  # a flag's: as given
    assert config.model == "embedded-vision" and config.mcp_config == "none"
