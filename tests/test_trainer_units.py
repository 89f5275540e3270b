"""Pieces of the trainer on their own: sample statistics, rank shares, weight loading, the TP degree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.store import DBRecordData
from agentrl.training.config import TrainConfig
from agentrl.training.data import sample_staleness, split_shares, to_merged, tokens_if_unmerged
from agentrl.training.launcher import BOOLEAN_FIELDS, LaunchConfigError, apply_launch_config
from agentrl.training.parallel import ParallelState
from agentrl.training.weights import WeightsError, export_pretrained, load_pretrained


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



def test_a_bf16_export_is_the_model_rounded_and_leaves_it_untouched(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = load_pretrained(tiny_model_dir)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    export_pretrained(model, ParallelState(), tmp_path / "bf16", dtype=torch.bfloat16)
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert saved and set(saved) <= set(before)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, before[name].to(torch.bfloat16)), name
    assert all(torch.equal(tensor, before[name]) and tensor.dtype == torch.float32
               for name, tensor in model.state_dict().items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

ACCELERATE_FSDP2 = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                   "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_RESHARD_AFTER_FORWARD": "false",
                   "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_OFFLOAD_PARAMS": "false",
                   "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}


def test_accelerate_config_fields_become_trainer_settings() -> None:
    assert apply_launch_config(TrainConfig(tp_size=4), {}).tp_size == 4
    resolved = apply_launch_config(TrainConfig(), ACCELERATE_FSDP2)
    assert (resolved.bf16, resolved.gradient_checkpointing, resolved.reshard_after_forward,
            resolved.cpu_ram_efficient_loading, resolved.tp_size) == (True, True, False, False, 2)
    assert apply_launch_config(TrainConfig(tp_size=2, bf16=True), ACCELERATE_FSDP2).tp_size == 2
    with pytest.raises(LaunchConfigError, match="--tp_size 4 disagrees with the accelerate config's "
                                                "parallelism_config_tp_size"):
        apply_launch_config(TrainConfig(tp_size=4), ACCELERATE_FSDP2)
    with pytest.raises(LaunchConfigError, match="--bf16 false disagrees with the accelerate config's mixed_precision"):
        apply_launch_config(TrainConfig(bf16=False), ACCELERATE_FSDP2)
    for variable, value, message in (("FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params"),
                                     ("FSDP_VERSION", "1", "fsdp_version 1"),
                                     ("ACCELERATE_MIXED_PRECISION", "fp16", "mixed_precision 'fp16'")):
        with pytest.raises(LaunchConfigError, match=message):
            apply_launch_config(TrainConfig(), {**ACCELERATE_FSDP2, variable: value})


def test_shipped_accelerate_configs_mean_what_they_say() -> None:
    """Every field of the shipped configs is one accelerate uses to launch or one the trainer applies."""
    import yaml

    launch = {"compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
              "main_training_function", "rdzv_backend", "same_network", "use_cpu", "downcast_bf16"}
    applied = {"mixed_precision", "fsdp_version", "fsdp_offload_params", "parallelism_config_dp_shard_size",
               *(field for field, _ in BOOLEAN_FIELDS.values()), "parallelism_config_tp_size"}
    for path in (Path(__file__).parents[1] / "assets" / "accelerate").glob("*.yml"):
        config = yaml.safe_load(path.read_text())
        fields = {k for k in config if k not in ("fsdp_config", "parallelism_config")}
        fields |= set(config.get("fsdp_config", {})) | set(config.get("parallelism_config", {}))
        assert fields <= launch | applied, (path.name, fields - launch - applied)
