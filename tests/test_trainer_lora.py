"""LoRA (``--use_peft``): only the adapters learn, for every loss; checkpoints hold a PEFT adapter that PEFT's own
loader reads and that gives the logprobs of the merged final model; a crash and resume is exact; FSDP2 on two
ranks gives the adapter of one process; bad combinations of flags are refused with a clear message."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

from agentrl.failpoints import ENV
from agentrl.store import sync_client
from agentrl.train import main
from agentrl.training import lora
from cli_helpers import agentrl
from trainer_fixtures import (
    enqueue,
    load_weights,
    make_samples,
    max_weight_difference,
    run_trainer,
    sft_samples,
    train_here,
    train_uninterrupted,
    trainer_args,
)

pytestmark = pytest.mark.slow

LORA = ("--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_target_modules",
        "all-linear")
FLAGS = ("--train_batch_size", "4", "--enable_sampling", "false", "--max_tokens", "64", "--adam_epsilon", "1e-6")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def _adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / lora.ADAPTER_WEIGHTS))


def _logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def test_gradients_reach_only_the_adapters(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = lora.lora_config(r=4, alpha=8, dropout=0.0, target_modules=["all-linear"], modules_to_save=None)
    lora.inject_lora(model, config)
    ids = torch.tensor([[5, 17, 99, 3, 250, 7]])
    model(input_ids=ids, labels=ids).loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(".lora_A." in name or ".lora_B." in name for name in with_grad), sorted(with_grad)
    adapted = {name.split(".lora_")[0] for name in with_grad}
    assert any(name.endswith("mlp.down_proj") for name in adapted) and not any("lm_head" in n for n in adapted)


def test_our_merge_equals_peft_merge_for_linear_embedding_and_saved_modules(tiny_model_dir: Path) -> None:
    """The state-dict merge the trainer publishes with (it works on FSDP2's gathered weights) against PEFT's own
    merge_and_unload, with every kind of adapted module: Linear, Embedding and a modules_to_save copy."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = lora.lora_config(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "down_proj", "embed_tokens"],
                              modules_to_save=["norm"])
    ours = lora.inject_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), config)
    with torch.no_grad():
        for _name, param in ours.named_parameters():
            if param.requires_grad:  # B starts at zero: give every adapter and saved copy a real update
                param.add_(torch.randn_like(param) * 0.05)
    merged = lora.merge_state_dict(ours, ours.state_dict())
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                               lora.lora_config(r=4, alpha=8, dropout=0.0,
                                                target_modules=["q_proj", "down_proj", "embed_tokens"],
                                                modules_to_save=["norm"]))
    reference.base_model.model.load_state_dict(ours.state_dict())
    expected = reference.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    differences = {k: float((merged[k] - expected[k]).abs().max()) for k in merged}
    assert max(differences.values()) < 1e-6, {k: v for k, v in differences.items() if v >= 1e-6}
    assert not torch.equal(merged["model.embed_tokens.weight"],
                           load_weights(tiny_model_dir)["model.embed_tokens.weight"])


def test_a_quantized_bases_adapters_merge_into_the_full_precision_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The export a 4-bit (QLoRA) run uses, which merges into the base model's own weights rather than the rounded
    4-bit ones, gives the same model as the trainer's state-dict merge (run here on a full-precision model: 4-bit
    needs CUDA)."""
    from transformers import AutoModelForCausalLM

    from agentrl.training.weights import export_merged_from_base

    torch.manual_seed(0)
    config = lora.lora_config(r=4, alpha=8, dropout=0.0, target_modules=["all-linear"], modules_to_save=None)
    model = lora.inject_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), config)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    export_merged_from_base(model, model.state_dict(), tmp_path / "merged")
    saved, expected = load_weights(tmp_path / "merged"), lora.merge_state_dict(model, model.state_dict())
    assert max(float((saved[name] - expected[name]).abs().max()) for name in saved) < 1e-6
    assert max_weight_difference(saved, load_weights(tiny_model_dir)) > 1e-3


@pytest.mark.parametrize("loss", ["GRPO", "MINIRL", "GSPO", "CrossEntropy"])
def test_each_loss_trains_the_adapters_and_leaves_the_base_weights(loss: str, db_uri: str, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    samples = sft_samples(8) if loss == "CrossEntropy" else make_samples(tiny_model_dir, groups=2)
    asyncio.run(enqueue(db_uri, samples))
    out = tmp_path / "out"
    assert main(trainer_args(db_uri, tiny_model_dir, out, *FLAGS, *LORA, "--loss_calculater", loss,
                             "--max_steps", "2", "--save_steps", "2")) == 0
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / lora.ADAPTER_CONFIG).is_file() and not (checkpoint / "model.safetensors").exists()
    config = json.loads((checkpoint / lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and "q_proj" in config["target_modules"]
    assert any(float(t.abs().max()) > 0 for k, t in _adapter(checkpoint).items() if "lora_B" in k), "B stayed 0"

    base, final = load_weights(tiny_model_dir), load_weights(out / "final")
    assert base.keys() == final.keys()  # the final model is a plain model of the base architecture, merged
    adapted = [k for k in base if k.endswith(("q_proj.weight", "down_proj.weight"))]
    frozen = [k for k in base if "norm" in k or "embed_tokens" in k]
    assert adapted and frozen
    assert all(not torch.equal(base[k], final[k]) for k in adapted)
    assert all(torch.equal(base[k], final[k]) for k in frozen), "a weight outside the adapters changed"


def test_peft_reads_the_checkpoint_and_gives_the_merged_logprobs(db_uri: str, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples = make_samples(tiny_model_dir, groups=2)
    asyncio.run(enqueue(db_uri, samples))
    out = tmp_path / "out"
    assert main(trainer_args(db_uri, tiny_model_dir, out, *FLAGS, *LORA, "--loss_calculater", "GRPO",
                             "--max_steps", "2", "--save_steps", "2")) == 0
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(out / "checkpoint-2")).eval()  # PEFT's loader, not ours
    merged = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for sample in samples[:4]:
        adapter_lp, merged_lp = _logprobs(with_adapter, sample.input_ids), _logprobs(merged, sample.input_ids)
        assert float((adapter_lp - merged_lp).abs().max()) < 1e-5
        assert float((_logprobs(plain, sample.input_ids) - merged_lp).abs().max()) > 1e-4  # it did learn

    # `agentrl model merge` (PEFT's merge_and_unload) gives the trainer's merged final weights
    result = agentrl("model", "merge", str(out / "checkpoint-2"), "--out", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert max_weight_difference(load_weights(tmp_path / "merged"), load_weights(out / "final")) < 1e-6
    refused = agentrl("model", "merge", str(out / "final"), "--out", str(tmp_path / "again"))
    assert refused.returncode == 1 and "not a LoRA adapter directory" in refused.stdout, refused.stdout


def test_a_crash_after_an_adapter_checkpoint_resumes_exactly(db_uri: str, mongo_server_uri: str,
                                                             tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(tiny_model_dir, groups=4)
    asyncio.run(enqueue(db_uri, samples))
    flags = (*FLAGS, *LORA, "--loss_calculater", "MINIRL", "--max_steps", "4", "--save_steps", "2")
    out = tmp_path / "crashed"
    crashed = run_trainer(trainer_args(db_uri, tiny_model_dir, out, *flags),
                          env={ENV: "trainer.checkpoint.before_mark_trained=exit"})
    assert crashed.returncode != 0 and (out / "checkpoint-2" / lora.ADAPTER_CONFIG).is_file(), crashed.stdout
    assert main(trainer_args(db_uri, tiny_model_dir, out, *flags, "--resume_from_checkpoint", "latest")) == 0

    reference = tmp_path / "reference"
    train_uninterrupted(mongo_server_uri, samples, tiny_model_dir, reference, *flags)
    assert max_weight_difference(_adapter(out / "checkpoint-4"), _adapter(reference / "checkpoint-4")) < 1e-6
    assert max_weight_difference(load_weights(out / "final"), load_weights(reference / "final")) < 1e-6
    client = sync_client(db_uri)
    try:
        docs = list(client.get_default_database().DBRecordData.find())
    finally:
        client.close()
    assert {d["status"] for d in docs} == {"trained"} and len(docs) == len(samples)


def test_fsdp2_with_adapters_on_two_ranks_matches_one_process(db_uri: str, mongo_server_uri: str,
                                                              tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = make_samples(tiny_model_dir, groups=2, per_turn=True)  # the turns of a trajectory credited apart
    assert all(len({a for a, m in zip(s.advantages, s.loss_mask) if m}) == 2 for s in samples)
    flags = (*FLAGS, *LORA, "--max_steps", "2", "--save_steps", "2")
    asyncio.run(enqueue(db_uri, samples))
    single = tmp_path / "single"
    assert main(trainer_args(db_uri, tiny_model_dir, single, *flags)) == 0
    sharded = tmp_path / "fsdp"
    result = train_uninterrupted(mongo_server_uri, samples, tiny_model_dir, sharded, *flags, launcher=TORCHRUN)
    assert result.returncode == 0, result.stdout
    assert "2 ranks (dp 2 × tp 1)" in result.stdout and "parameters trainable" in result.stdout
    assert max_weight_difference(_adapter(sharded / "checkpoint-2"), _adapter(single / "checkpoint-2")) < 1e-5
    assert max_weight_difference(load_weights(sharded / "final"), load_weights(single / "final")) < 1e-5


@pytest.mark.parametrize(("flags", "message"), [
    (("--lora_r", "8"), "LoRA flags without --use_peft: --lora_r"),
    (("--use_peft", "--load_in_4bit"), "--load_in_4bit needs a CUDA GPU"),
    (("--use_peft", "--lora_target_modules", "all-linear", "q_proj"), "'all-linear' stands alone"),
    (("--use_peft", "--lora_target_modules", "no_such_module"), "not found in the base model"),
    (("--lora_publish", "adapter"), "LoRA flags without --use_peft: --lora_publish"),
    (("--use_peft", "--lora_target_modules", "embed_tokens", "--lora_publish", "adapter"),
     "serve adapters of Linear layers only, and model.embed_tokens is not one"),
])
def test_bad_lora_flags_are_refused(flags: tuple[str, ...], message: str, db_uri: str, tiny_model_dir: Path,
                                    tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    caplog: pytest.LogCaptureFixture) -> None:
    """Refused with the message and a non-zero exit code (``python -m agentrl.train`` exits with what ``main``
    returns; run here, in the test's process: an exception would escape and fail the test)."""
    code, log = train_here(trainer_args(db_uri, tiny_model_dir, tmp_path / "out", *FLAGS, *flags), caplog)
    output = capsys.readouterr().err + log
    assert code != 0 and message in output, output
    assert "Traceback" not in output, output


def test_an_adapter_of_a_vision_tower_is_not_published(db_uri: str, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``--lora_publish adapter`` of a vision-language policy adapts its language model only (an engine encodes a
    picture once for every adapter): a target in the tower (Qwen2.5-VL's vision blocks have a gate_proj) is refused
    at setup, naming the layer."""
    from agentrl.inference.tiny_model import build_tiny_vision_model

    model = build_tiny_vision_model(tmp_path / "vlm")
    code, log = train_here(trainer_args(db_uri, model, tmp_path / "out", *FLAGS, "--use_peft", "--lora_target_modules",
                                        "gate_proj", "--lora_publish", "adapter"), caplog)
    assert code != 0 and "adapts the vision tower's model.visual.blocks.0.mlp.gate_proj" in log, log
