"""Every place that states a default of the main job or its duration states the one the code has: the numbers in
``minirl_example.sh``'s header and in docs/running.md's table of variables are the options `agentrl run` resolves
with its preset cpu-demo and nothing else set, and the README and the script give the same duration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentrl.run.config import SECTIONS, SHARED, SHORT_NAMES, RunConfig
from agentrl.run.layers import resolve

ROOT = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"^-?\d+(\.\d+)?(e-?\d+)?$")


@pytest.fixture(scope="module")
def resolved() -> dict[str, object]:
    """The options of the example scripts with nothing set, by the variable that names each (``LORA_R`` →
    lora_r)."""
    config = resolve({}, "cpu-demo").config
    values = {name.upper(): getattr(config, name) for name in RunConfig.model_fields if name not in SECTIONS}
    values.update({name.upper(): config.value(name) for name in SHARED["rl"]})
    values.update({name.upper(): config.section_value(*target) for name, target in SHORT_NAMES.items()})
    return values


def numbers_stated(text: str, pattern: str) -> dict[str, str]:
    """``VARIABLE`` -> the number stated right after it by ``pattern`` (a regex with the two groups)."""
    return {name: value for name, value in re.findall(pattern, text) if NUMBER.match(value)}


def test_the_scripts_header_states_the_resolved_defaults(resolved: dict[str, object]) -> None:
    header = "".join(line for line in (ROOT / "minirl_example.sh").read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    stated = numbers_stated(header, r"\b([A-Z][A-Z_]+) \(([-\d.e]+)[);:]")
    assert {"TRAIN_STEPS", "LEARNING_RATE", "MAX_STALENESS", "SYNC_EVERY", "MAX_TURNS", "TEMPERATURE"} <= set(stated)
    wrong = {name: (value, resolved[name]) for name, value in stated.items() if float(value) != resolved[name]}
    assert not wrong, f"minirl_example.sh states (stated, resolved): {wrong}"


def test_the_docs_table_states_the_resolved_defaults(resolved: dict[str, object]) -> None:
    rows = [line.split("|")[1:3] for line in (ROOT / "docs" / "running.md").read_text().splitlines()
            if line.startswith("| `")]
    stated = {}
    for names, defaults in rows:
        variables = re.findall(r"`([A-Z][A-Z_]+)`", names.split("(")[0] if "(`--" in names else names)
        values = [value.strip() for value in defaults.split(",")]
        if len(variables) == len(values):
            stated.update((name, value) for name, value in zip(variables, values, strict=True) if NUMBER.match(value))
    assert {"TRAIN_STEPS", "LEARNING_RATE", "MAX_STALENESS", "SYNC_EVERY", "NUM_GENERATIONS"} <= set(stated)
    wrong = {name: (value, resolved[name]) for name, value in stated.items() if float(value) != resolved[name]}
    assert not wrong, f"docs/running.md states (stated, resolved): {wrong}"


def test_the_readme_and_the_script_give_one_duration() -> None:
    pattern = r"about ([\d½¼¾]+) minutes"
    readme = re.findall(pattern, (ROOT / "README.md").read_text())
    script = re.findall(pattern, (ROOT / "minirl_example.sh").read_text())
    assert readme and script and set(readme) == set(script), (readme, script)


def test_the_readme_states_the_rl_phases_time_limit(resolved: dict[str, object]) -> None:
    fractions = {"": 0.0, "¼": 0.25, "½": 0.5, "¾": 0.75}
    found = re.search(r"MINIRL for (\d+)([¼½¾]?) minutes", (ROOT / "README.md").read_text())
    assert found, "the README no longer says how long RL runs"
    assert (int(found.group(1)) + fractions[found.group(2)]) * 60 == resolved["TRAIN_TIME_S"]
