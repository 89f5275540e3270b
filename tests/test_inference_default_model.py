"""``agentrl engine`` with no model flag serves the embedded SmolLM2-135M-Instruct to openai and raw clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest
from transformers import AutoTokenizer

from agentrl.inference import SGLangClient
from agentrl.inference.embedded_model import default_model_path
from agentrl.inference.process import EngineProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 2+3?"}]




@pytest.fixture(scope="module")
def default_engine(launch_engine: Callable[..., EngineProcess]) -> Iterator[EngineProcess]:
    process = launch_engine(None)  # no --model_name_or_path: the embedded model
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output


@pytest.mark.parametrize("question", ["Say hello.", "What is 2+2?", "Name a color."])
async def test_the_same_greedy_request_gets_the_same_answer_from_the_first_on(default_engine: EngineProcess,
                                                                             question: str) -> None:
    # Before: the second and later "Say hello." requests (33 tokens: one page from the prefix cache, the last token
    # computed alone) answered otherwise than the first from their 7th token, logprobs 0.01-0.1 nats apart; later
    # the same on a Xeon with AMX, whose kernels depend on the row count (the start-up line now says how the
    # engine lays out its rows there; the emulated kernels: tests/test_inference_paged_attention.py).
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=False)
    input_ids = tokenizer.encode(input_ids, add_special_tokens=False)
    async with SGLangClient(default_engine.url) as client:
        await client.flush_cache()  # the first request computes its whole prompt, the others find it cached
        results = [await client.generate(input_ids, {"max_new_tokens": 12, "temperature": 0}) for _ in range(3)]
    assert [r.output_ids for r in results] == [results[0].output_ids] * 3
    assert [r.output_token_logprobs for r in results] == [results[0].output_token_logprobs] * 3
    assert "NOT cache-invariant" not in default_engine.output


async def test_openai_client_gets_an_answer(default_engine: EngineProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{default_engine.url}/v1", api_key="EMPTY", max_retries=0)
    try:
        completion = await client.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                                          max_tokens=24)
    finally:
        await client.close()
    assert completion.model == default_model_path().name
    assert completion.choices[0].finish_reason == "stop"
    assert "5" in completion.choices[0].message.content


async def test_raw_generate_stops_at_the_models_eos(default_engine: EngineProcess) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer.encode(prompt, add_special_tokens=False)
    async with SGLangClient(default_engine.url) as client:
        result = await client.generate(input_ids, {"max_new_tokens": 24, "temperature": 0})
    assert (result.finish_reason, result.matched_stop) == ("stop", tokenizer.eos_token_id)
    assert result.output_ids[-1] == tokenizer.eos_token_id and "<|im_end|>" not in result.text
    assert "5" in result.text and len(result.output_token_logprobs) == result.completion_tokens
