"""EOS and length handling as in SGLang, on an in-process engine whose EOS token is one the model emits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from agentrl.inference.engine import BadRequest, EngineConfig, InferenceEngine
from agentrl.inference.protocol import GenerateRequest

torch.set_num_threads(1)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]


def request(**sampling) -> GenerateRequest:
    return GenerateRequest(input_ids=PROMPT, sampling_params=sampling, return_logprob=True)


async def run(model_dir: Path, *requests: GenerateRequest, max_total_tokens: int = 4096):
    engine = InferenceEngine(EngineConfig(model_name_or_path=str(model_dir), max_total_tokens=max_total_tokens))
    engine.start()
    try:
        return [await engine.generate(r) for r in requests]
    finally:
        engine.stop()


def with_eos(model_dir: Path, target: Path, eos: int) -> Path:
    shutil.copytree(model_dir, target)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((target / name).read_text())
        config["eos_token_id"] = eos
        (target / name).write_text(json.dumps(config))
    return target


async def test_eos_stops_generation_like_sglang(tiny_model_dir: Path, tmp_path: Path) -> None:
    (greedy,) = await run(tiny_model_dir, request(max_new_tokens=6, temperature=0))
    eos = greedy.output_ids[2]
    first = greedy.output_ids.index(eos)
    stopped, ignored, at_limit, empty = await run(
        with_eos(tiny_model_dir, tmp_path / "eos", eos),
        request(max_new_tokens=6, temperature=0), request(max_new_tokens=6, temperature=0, ignore_eos=True),
        request(max_new_tokens=first + 1, temperature=0), request(max_new_tokens=0))
    assert stopped.output_ids == greedy.output_ids[: first + 1]
    assert stopped.meta_info.finish_reason.model_dump() == {"type": "stop", "matched": eos}
    assert len(stopped.meta_info.output_token_logprobs) == first + 1
    assert ignored.output_ids == greedy.output_ids and ignored.meta_info.finish_reason.type == "length"
    # SGLang checks the length limit before stop tokens
    assert at_limit.meta_info.finish_reason.model_dump() == {"type": "length", "length": first + 1}
    assert empty.output_ids == [] and empty.meta_info.finish_reason.model_dump() == {"type": "length", "length": 0}


async def test_requests_beyond_the_cache_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(BadRequest, match="max_total_tokens"):
        await run(tiny_model_dir, request(max_new_tokens=1500), max_total_tokens=1024)
