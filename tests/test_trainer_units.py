"""Pieces of the trainer on their own: sample statistics, rank shares, weight loading, the TP degree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.store import DBRecordData
from agentrl.training.data import sample_staleness, split_shares, to_merged, tokens_if_unmerged
from agentrl.training.parallel import ParallelError, resolve_tp_size
from agentrl.training.weights import WeightsError, load_pretrained



def _sample(**fields) -> DBRecordData:
    base = {"id": "s", "record_id": "r", "task_id": "t", "seq": 1, "input_ids": list(range(10)),
            "loss_mask": [0] * 10, "logprobs": [0.0] * 10, "versions": [-1] * 10, "advantages": [0.0] * 10,
            "num_tokens": 10}
    return DBRecordData(**{**base, **fields})


def test_tokens_if_unmerged_counts_one_pass_per_trained_turn() -> None:
    # turns start at 0, 4 and 7: [0,4) [4,7) [7,10); the middle turn has no loss token
    mask = [0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    sample = _sample(loss_mask=mask, turn_boundaries=[0, 4, 7])
    assert tokens_if_unmerged(sample) == 4 + 10
    assert tokens_if_unmerged(_sample(loss_mask=mask)) == 10  # no boundaries: one turn


def test_staleness_uses_the_oldest_version_on_loss_tokens() -> None:
    sample = _sample(loss_mask=[0, 1, 1, 0, 1, 0, 0, 0, 0, 0], versions=[-1, 3, 3, 1, 5, -1, -1, -1, -1, -1])
    assert sample_staleness(sample, 6) == 3  # version 1 sits on a context token, not a loss token
    assert sample_staleness(_sample(), 6) == 0  # no version known (SFT data)


def test_shares_cover_the_batch() -> None:
    assert split_shares(10, 4) == [3, 3, 2, 2] and split_shares(4, 4) == [1, 1, 1, 1]


def test_inconsistent_samples_are_rejected_with_their_id() -> None:
    with pytest.raises(ValueError, match="DBRecordData s: advantages has 3 entries for 10 input_ids"):
        to_merged(_sample(advantages=[0.0] * 3))


def test_pretrained_weights_are_required(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(WeightsError, match="no weights in .* never from a random initialisation"):
        load_pretrained(empty)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    dropped = next(name for name in weights if "mlp" in name)
    del weights[dropped]
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=f"1 missing .*{dropped}"):
        load_pretrained(partial)
    model = load_pretrained(tiny_model_dir)
    assert torch.equal(dict(model.named_parameters())[dropped], load_file(
        str(tiny_model_dir / "model.safetensors"))[dropped])
    assert json.loads((tiny_model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tp_degree_from_flag_or_accelerate_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    assert resolve_tp_size(None) == 1 and resolve_tp_size(4) == 4
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    assert resolve_tp_size(None) == 2 and resolve_tp_size(2) == 2
    with pytest.raises(ParallelError, match="--tp_size 4 disagrees"):
        resolve_tp_size(4)
