"""``agentrl engine`` as a real subprocess on the tiny model: contract, batching, sampling semantics, bad requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.inference import SGLangClient
from agentrl.inference.consistency import logprob_mismatch

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2]


async def test_generate_response_contract(engine_url: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True, "rid": "contract-1"}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        response = await http.post("/generate", json=body)
    assert response.status_code == 200
    payload = response.json()
    assert set(payload) == {"text", "output_ids", "meta_info"}
    meta = payload["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "e2e_latency", "output_token_logprobs"} <= set(meta)
    assert meta["id"] == "contract-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 6)
    assert meta["weight_version"] == "0"
    assert len(payload["output_ids"]) == 6 and isinstance(payload["text"], str)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == payload["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)


async def test_text_prompt_and_token_texts(engine_url: str, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        payload = (await http.post("/generate", json=body)).json()
    meta = payload["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer.encode(body["text"]))
    assert [t[2] for t in meta["output_token_logprobs"]] == [tokenizer.decode([i]) for i in payload["output_ids"]]


async def test_admin_endpoints_contract(engine_url: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/health_generate")).status_code == 200
        info = (await http.get("/get_model_info")).json()
        assert info["is_generation"] is True and info["weight_version"] == "0"
        assert {"model_path", "tokenizer_path", "preferred_sampling_params"} <= set(info)
        flushed = await http.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    async with SGLangClient(engine_url) as client:
        assert await client.health() and await client.health_generate()
        assert (await client.get_model_info()).weight_version == "0"
        assert await client.flush_cache()


async def test_concurrent_requests_are_batched(engine_url: str) -> None:
    params = {"max_new_tokens": 48, "ignore_eos": True}
    prompts = [[*PROMPT, i + 10] for i in range(16)]
    async with SGLangClient(engine_url) as client:
        await client.generate(PROMPT, {"max_new_tokens": 4})  # warm up
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            await client.generate(prompt, {**params, "sampling_seed": i})
        sequential_s = time.perf_counter() - started
        started = time.perf_counter()
        results = await asyncio.gather(*[
            client.generate(prompt, {**params, "sampling_seed": i}) for i, prompt in enumerate(prompts)])
        concurrent_s = time.perf_counter() - started
    assert all(r.completion_tokens == 48 and len(r.output_token_logprobs) == 48 for r in results)
    assert len({tuple(r.output_ids) for r in results}) == 16
    # Served one after the other, the 16 concurrent requests would take as long as the same 16 in sequence (measured
    # just before, so machine load affects both); decoded in one batch they take far less (about half on 2 cores).
    print(f"16 in sequence {sequential_s:.3f}s, 16 concurrent {concurrent_s:.3f}s")
    assert concurrent_s < 0.8 * sequential_s, (concurrent_s, sequential_s)


async def test_seed_makes_a_request_reproducible(engine_url: str) -> None:
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95, "sampling_seed": 1234}
    async with SGLangClient(engine_url) as client:
        first, second, other = await asyncio.gather(
            client.generate(PROMPT, params), client.generate(PROMPT, params),
            client.generate(PROMPT, {**params, "sampling_seed": 99}))
    assert first.output_ids == second.output_ids
    assert first.output_token_logprobs == pytest.approx(second.output_token_logprobs, abs=1e-5)
    assert other.output_ids != first.output_ids


async def test_stop_token_ids_ignore_eos_and_length(engine_url: str) -> None:
    async with SGLangClient(engine_url) as client:
        greedy = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0})
        stop_at = greedy.output_ids[3]
        first = greedy.output_ids.index(stop_at)
        stopped = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at]})
        ignored = await client.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at],
                                                 "ignore_eos": True})
    assert greedy.finish_reason == "length" and greedy.completion_tokens == 12
    assert stopped.output_ids == greedy.output_ids[: first + 1]  # the stop token is part of output_ids
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop_at)
    assert ignored.output_ids == greedy.output_ids and ignored.finish_reason == "length"


async def test_stop_strings_trim_the_text(engine_url: str) -> None:
    async with SGLangClient(engine_url) as client:
        greedy = await client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0})
        stop = greedy.text[len(greedy.text) // 2:][:4]
        assert stop.strip(), greedy.text
        stopped = await client.generate(PROMPT, {"max_new_tokens": 10, "temperature": 0, "stop": [stop]})
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop)
    assert stopped.text == greedy.text[: greedy.text.find(stop)]
    assert stopped.output_ids == greedy.output_ids[: len(stopped.output_ids)]
    assert len(stopped.output_ids) < 10


async def test_logprobs_match_a_trainer_forward_pass(engine_url: str, tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    async with SGLangClient(engine_url) as client:
        for temperature in (1.0, 0.7, 0.0):
            result = await client.generate(PROMPT, {"max_new_tokens": 32, "temperature": temperature,
                                                    "sampling_seed": 5, "ignore_eos": True})
            mismatch = logprob_mismatch(model, PROMPT, result.output_ids, result.output_token_logprobs,
                                        temperature=temperature)
            assert mismatch["num_tokens"] == 32
            assert mismatch["max_abs_diff"] <= 1e-4, (temperature, mismatch)


async def test_chat_completions_with_the_openai_client(engine_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="EMPTY", max_retries=0)
    try:
        completion = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0,
            logprobs=True)
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model="tiny", messages=[], max_tokens=8)
    finally:
        await client.close()
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 8
    assert len(choice.logprobs.content) == 8


@pytest.mark.parametrize(("body", "fragment"), [
    ({"input_ids": PROMPT, "bogus_field": 1}, "bogus_field"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1, 49152]}, "outside the vocabulary"),
    ({"input_ids": [1, -5]}, "negative token id"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": PROMPT, "sampling_params": {"seed": 1}}, "seed"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [10 ** 6]}}, "stop_token_ids"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5000}}, "context length"),
    ({"input_ids": [[1, 2], [3]]}, "input_ids"),
    ({"input_ids": PROMPT, "stream": True}, "stream"),
])
async def test_bad_requests_get_400_with_a_message(engine_url: str, body: dict, fragment: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        response = await http.post("/generate", json=body)
        assert response.status_code == 400, response.text
        assert fragment in response.json()["error"]["message"]
        assert (await http.get("/health")).status_code == 200


async def test_malformed_json_gets_400(engine_url: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        response = await http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()
        update = await http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/ckpt"})
    assert update.status_code == 400
    assert update.json()["success"] is False and "/nonexistent/ckpt" in update.json()["message"]



def _prompt_logprobs(model_dir: Path, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / temperature) of ids[i] given ids[:i], for i >= 1, from a plain fp32 forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


async def test_prompt_token_logprobs_as_sglang_returns_them(engine_url: str, tiny_model_dir: Path) -> None:
    """``logprob_start_len`` k: ``input_token_logprobs`` holds ``[logprob, id, text]`` of the prompt tokens from k
    on, the first one's logprob null (SGLang's scheduler), tempered like the output's, from the same weights; -1
    (the default): the last prompt token only; a start at or past the prompt's end is a 400 with SGLang's message."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as http:
        async def ask(**fields: object) -> httpx.Response:
            return await http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, **fields,
                                                      "sampling_params": {"max_new_tokens": 2, "temperature": 0.7}})

        whole, tail, default, too_far = await asyncio.gather(
            ask(logprob_start_len=0), ask(logprob_start_len=4, return_text_in_logprobs=True), ask(),
            ask(logprob_start_len=len(PROMPT)))
    tempered = _prompt_logprobs(tiny_model_dir, PROMPT, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(tempered, _prompt_logprobs(tiny_model_dir, PROMPT))) > 1e-3
    entries = whole.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT and entries[0][0] is None and all(e[2] is None for e in entries)
    assert max(abs(e[0] - t) for e, t in zip(entries[1:], tempered, strict=True)) < 1e-4
    entries = tail.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[4:] and entries[0][0] is None
    assert [e[2] for e in entries] == [AutoTokenizer.from_pretrained(tiny_model_dir).decode([i]) for i in PROMPT[4:]]
    assert max(abs(e[0] - t) for e, t in zip(entries[1:], tempered[4:], strict=True)) < 1e-4
    assert default.json()["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert too_far.status_code == 400, too_far.text
    assert (f"logprob_start_len ({len(PROMPT)}) is higher than the number of input tokens ({len(PROMPT)})"
            in too_far.json()["error"]["message"])


def test_the_engine_leaves_a_core_to_its_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its default thread team is one less than its CPUs (one thread beat two on 2 cores at every concurrency
    measured), and ``$OMP_NUM_THREADS`` overrides it."""
    import os

    from agentrl.inference.engine import default_num_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cpus, threads in ((1, 1), (2, 1), (16, 15)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert default_num_threads() == threads
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS has no affinity: all its CPUs
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert default_num_threads() == 7
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert default_num_threads() == 4
