"""The policy probe's bound: how far a correct service's prompt logprobs are from the trainer's.

Usage: ``.venv/bin/python bench/policy_probe.py [--model_name_or_path DIR] [--device cpu|cuda]``

The trainer's logprobs of the probe sequence (``agentrl.training.policy_probe``: ``PROBE_TEXT``, fp32, the LM head
in fp32) are compared with those an ``agentrl engine`` (in this process, ``InferenceEngine``) returns for the same
tokens through ``/generate`` with ``logprob_start_len`` 0, once with the engine in fp32 and once in bf16, on the
same weights. Then the trainer's logprobs with its weights moved (each by Gaussian noise of ``--perturb`` times the
mean magnitude of its tensor), a stand-in for the policy a service that missed publishes is behind by. Prints a
table (mean and max |served − trainer| over the scored tokens) and writes JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.inference.embedded_model import default_model_path
from agentrl.inference.engine import EngineConfig, InferenceEngine, resolve_device
from agentrl.inference.protocol import GenerateRequest
from agentrl.training.policy_probe import probe_token_ids, trainer_logprobs


def served_logprobs(model_dir: str, dtype: str, device: str, token_ids: list[int]) -> list[float]:
    """The prompt logprobs an engine in ``dtype`` returns for ``token_ids`` (the first token has none)."""
    engine = InferenceEngine(EngineConfig(model_name_or_path=model_dir, device=device, dtype=dtype))
    engine.start()
    try:
        request = GenerateRequest(input_ids=token_ids, return_logprob=True, logprob_start_len=0,
                                  sampling_params={"max_new_tokens": 1, "temperature": 1.0})
        response = asyncio.run(engine.generate(request))
    finally:
        engine.stop()
    return [entry[0] for entry in response.meta_info.input_token_logprobs[1:]]


def gaps(served: list[float], expected: list[float]) -> dict[str, float]:
    differences = [abs(s - e) for s, e in zip(served, expected, strict=True)]
    return {"mean_abs_diff": math.fsum(differences) / len(differences), "max_abs_diff": max(differences)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", default=str(default_model_path()))
    parser.add_argument("--device", default=None)
    parser.add_argument("--perturb", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2],
                        help="relative sizes of the weight changes standing in for missed publishes")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "policy_probe.json")
    args = parser.parse_args()
    device = resolve_device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).to(device)
    token_ids = probe_token_ids(tokenizer)
    expected = trainer_logprobs(model, token_ids, device)
    rows = {f"engine {dtype}": gaps(served_logprobs(args.model_name_or_path, dtype, str(device), token_ids), expected)
            for dtype in ("float32", "bfloat16")}
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for size in args.perturb:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                noise = torch.randn(param.shape, generator=generator).to(device)
                param.add_(noise * param.abs().mean() * size)
        rows[f"fp32 weights moved by {size:g} of their scale"] = gaps(trainer_logprobs(model, token_ids, device),
                                                                       expected)
        model.load_state_dict(original)
    result = {"model": args.model_name_or_path, "device": str(device), "scored_tokens": len(expected),
              "torch": torch.__version__, "machine": platform.machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{len(expected)} scored tokens of the probe sequence, {args.model_name_or_path} on {device}")
    print(f"{'served vs trainer fp32':40s} {'mean |diff|':>12s} {'max |diff|':>12s}")
    for name, row in rows.items():
        print(f"{name:40s} {row['mean_abs_diff']:12.3g} {row['max_abs_diff']:12.3g}")


if __name__ == "__main__":
    main()
