"""``agentrl engine`` sampling parameters, on a real engine process serving the tiny model: the server's
``--preferred_sampling_params`` fill what a request omits (as in SGLang), presence/frequency penalties follow
OpenAI's semantics over the generated tokens and shape the returned logprobs (as in SGLang), min_p truncates."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineProcess

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2]


@pytest.fixture(scope="module")
def preferred_engine(launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path) -> Iterator[EngineProcess]:
    """An engine whose own default is greedy decoding (SGLang's ``--preferred-sampling-params``)."""
    engine = launch_engine(tiny_model_dir, "--preferred_sampling_params", '{"temperature": 0, "top_p": 0.5}')
    try:
        yield engine
    finally:
        engine.stop()


def penalised_logprobs(model: torch.nn.Module, output_ids: list[int], presence: float,
                       frequency: float) -> list[float]:
    """``log_softmax(logits - presence * (count > 0) - frequency * count)`` of each output token (greedy: T = 1)."""
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    result = []
    for position, token in enumerate(output_ids):
        counts = torch.bincount(torch.tensor(output_ids[:position], dtype=torch.long), minlength=logits.size(-1))
        penalised = logits[position] - presence * (counts > 0) - frequency * counts
        result.append(torch.log_softmax(penalised, -1)[token].item())
    return result


async def test_omitted_parameters_come_from_the_servers_preferred_ones(preferred_engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=preferred_engine.url, timeout=120) as http:
        info = (await http.get("/get_model_info")).json()
        omitted = [(await http.post("/generate", json=body)).json()["output_ids"] for _ in range(2)]
    assert info["preferred_sampling_params"] == {"temperature": 0, "top_p": 0.5}
    async with SGLangClient(preferred_engine.url) as client:  # the client sends every parameter
        greedy = await client.generate(PROMPT, {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0})
        sampled = await client.generate(PROMPT, {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0,
                                                 "sampling_seed": 3})
    assert omitted[0] == omitted[1] == greedy.output_ids  # the server's own default: greedy
    assert sampled.output_ids != greedy.output_ids  # an explicit temperature 1 and top_p 1 are honoured


async def test_penalties_follow_openai_semantics_and_shape_the_logprobs(preferred_engine: EngineProcess,
                                                                       tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}
    async with SGLangClient(preferred_engine.url) as client:
        plain = await client.generate(PROMPT, base)
        presence = await client.generate(PROMPT, {**base, "presence_penalty": 2.0})
        frequency = await client.generate(PROMPT, {**base, "frequency_penalty": -1.0})
    assert max(Counter(plain.output_ids).values()) > 1  # greedy decoding of the tiny model repeats itself
    # the tiny model's logits span far less than 2: a presence penalty of 2 forbids any repeat, and a negative
    # frequency penalty makes the first token win ever more
    assert max(Counter(presence.output_ids).values()) == 1
    assert set(frequency.output_ids) == {frequency.output_ids[0]}
    for result, (p, f) in ((plain, (0.0, 0.0)), (presence, (2.0, 0.0)), (frequency, (0.0, -1.0))):
        expected = penalised_logprobs(model, result.output_ids, p, f)
        assert result.output_token_logprobs == pytest.approx(expected, abs=1e-4), (p, f)
    # a trainer computes the unpenalised logprobs: far from the behaviour logprobs the engine reported
    unpenalised = penalised_logprobs(model, frequency.output_ids, 0.0, 0.0)
    assert min(b - a for a, b in zip(unpenalised[2:], frequency.output_token_logprobs[2:])) > 1.0


async def test_min_p_keeps_only_the_tokens_near_the_top(preferred_engine: EngineProcess) -> None:
    async with SGLangClient(preferred_engine.url) as client:
        greedy = await client.generate(PROMPT, {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0})
        only_top = await client.generate(PROMPT, {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.0,
                                                  "min_p": 1.0, "sampling_seed": 9})
    assert only_top.output_ids == greedy.output_ids  # min_p 1 keeps the most probable token only


async def test_unsupported_repetition_penalty_is_refused(preferred_engine: EngineProcess) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "repetition_penalty": 1.1}}
    async with httpx.AsyncClient(base_url=preferred_engine.url, timeout=60) as http:
        response = await http.post("/generate", json=body)
    assert response.status_code == 400 and "repetition_penalty" in response.json()["error"]["message"]
