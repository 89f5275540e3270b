"""`agentrl run` gives each process it starts the same configuration as the example scripts always did: for each
scenario of :data:`run_commands.SCENARIOS` (the three scripts, the environments, LoRA, a model of one's own, every
variable, the original's trainer flags through EXTRA_TRAIN_FLAGS) the commands, parsed by their own parsers, equal
those recorded in ``tests/data/run_commands.json`` before the options became one tree (``python
tests/run_commands.py FILE`` records them again, after a change meant to alter them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from run_commands import SCENARIOS, scenario_commands

RECORDED = json.loads((Path(__file__).parent / "data" / "run_commands.json").read_text())


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_example_scripts_start_the_commands_they_always_did(scenario: str, tmp_path: Path) -> None:
    found = scenario_commands(scenario, tmp_path)
    assert [command["name"] for command in found] == [command["name"] for command in RECORDED[scenario]]
    for command, recorded in zip(found, RECORDED[scenario], strict=True):
        assert command == recorded, command["name"]
