"""LoRA adapters in a real ``agentrl engine --enable_lora`` subprocess, checked against PEFT's own merged models.

Adapters are written by PEFT (``get_peft_model`` + ``save_pretrained``, random non-zero B), loaded over HTTP with
SGLang's ``/load_lora_adapter``, and named per request in ``lora_path``; one batch mixes two adapters and the base
model. Errors use SGLang's texts and shapes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.inference import InferenceRequestError, SGLangClient
from agentrl.inference.process import EngineProcess

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
SGLANG = json.loads((Path(__file__).parent / "contracts" / "sglang_api.json").read_text())


@pytest.fixture(scope="module")
def engine(launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path) -> Iterator[EngineProcess]:
    process = launch_engine(tiny_model_dir, "--enable_lora")
    try:
        yield process
    finally:
        assert process.stop() == 0, process.output


def _peft_adapter(model_dir: Path, out: Path, *, seed: int, **config: object) -> torch.nn.Module:
    """Save a PEFT LoRA adapter with random weights into ``out``; return PEFT's merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(init_lora_weights=False, **config))  # type: ignore[arg-type]
    model.save_pretrained(out)
    return model.merge_and_unload().eval()


def _logprobs(model: torch.nn.Module, output_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)


async def test_each_request_gets_its_adapter_in_a_mixed_batch(engine: EngineProcess, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    merged = {
        "a": _peft_adapter(tiny_model_dir, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear"),
        "b": _peft_adapter(tiny_model_dir, tmp_path / "b", seed=2, r=2, lora_alpha=4, use_rslora=True,
                           target_modules=["q_proj", "v_proj"]),
        None: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(),
    }
    async with SGLangClient(engine.url) as client:
        loaded = await client.load_lora_adapter("a", str(tmp_path / "a"))
        assert loaded.loaded_adapters == {"a": str(tmp_path / "a")}
        loaded = await client.load_lora_adapter("b", str(tmp_path / "b"))
        assert set(loaded.loaded_adapters or {}) == {"a", "b"}
        names = ["a", "b", None] * 3
        results = await asyncio.gather(*(
            client.generate(PROMPT, {**SAMPLED, "sampling_seed": i}, lora_path=name) for i, name in enumerate(names)))
        info = await client.get_model_info()
        for name in ("a", "b"):
            await client.unload_lora_adapter(name)
    assert info.weight_version == "0"  # as in SGLang, adapters leave the weight version alone
    for name, result in zip(names, results, strict=True):
        assert result.lora_path == name and result.weight_version == "0"
        expected = _logprobs(merged[name], result.output_ids)
        assert torch.allclose(torch.tensor(result.output_token_logprobs), expected, atol=1e-4), name
        others = [_logprobs(merged[other], result.output_ids) for other in merged if other != name]
        assert all(not torch.allclose(torch.tensor(result.output_token_logprobs), o, atol=1e-3) for o in others)


async def test_prompt_logprobs_are_the_adapters(engine: EngineProcess, tiny_model_dir: Path,
                                                tmp_path: Path) -> None:
    """``input_token_logprobs`` of a request naming an adapter come from the adapted model (the policy probe scores
    an adapter publish this way)."""
    merged = _peft_adapter(tiny_model_dir, tmp_path / "p", seed=3, r=4, lora_alpha=8, target_modules="all-linear")
    async with SGLangClient(engine.url) as client:
        await client.load_lora_adapter("p", str(tmp_path / "p"))
        try:
            adapted, base = await asyncio.gather(*(client.generate(
                PROMPT, {"max_new_tokens": 1, "temperature": 1.0}, lora_path=name, logprob_start_len=0)
                for name in ("p", None)))
        finally:
            await client.unload_lora_adapter("p")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(input_ids=ids).logits[0, :-1], dim=-1)
    expected = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert adapted.input_token_logprobs[0] is None and base.input_token_logprobs[0] is None
    assert torch.allclose(torch.tensor(adapted.input_token_logprobs[1:]), expected, atol=1e-4)
    assert not torch.allclose(torch.tensor(base.input_token_logprobs[1:]), expected, atol=1e-3)


async def test_unloading_waits_for_the_requests_using_the_adapter(engine: EngineProcess, tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    _peft_adapter(tiny_model_dir, tmp_path / "slow", seed=3, r=2, lora_alpha=2, target_modules=["o_proj"])
    async with SGLangClient(engine.url) as client:
        await client.load_lora_adapter("slow", str(tmp_path / "slow"))
        running = asyncio.create_task(client.generate(PROMPT, {**SAMPLED, "max_new_tokens": 400}, lora_path="slow"))
        async with httpx.AsyncClient(base_url=engine.url) as http:
            while (await running_requests(http)) == 0:  # until it is admitted
                assert not running.done()
                await asyncio.sleep(0.01)
            assert not running.done(), "the request must still be running when the adapter is unloaded"
            unloaded = await client.unload_lora_adapter("slow")
            # the unload answered once the request was over (its own answer may reach this client a moment later)
            assert await running_requests(http) == 0
            assert len((await running).output_ids) == 400  # it finished with its adapter
        assert unloaded.loaded_adapters == {}
        with pytest.raises(InferenceRequestError, match="requested LoRA adapters are not loaded: slow"):
            await client.generate(PROMPT, SAMPLED, lora_path="slow")


async def running_requests(http: httpx.AsyncClient) -> int:
    """The engine's admitted requests, from SGLang's ``/v1/loads`` (whose keys it uses: see the SGLang contract)."""
    body = (await http.get("/v1/loads")).json()
    assert set(body) <= set(SGLANG["loads"]["response_keys"]) and set(body["loads"][0]) <= set(
        SGLANG["loads"]["core_keys"]), body
    return body["loads"][0]["num_running_reqs"]


@pytest.mark.parametrize(("config", "message"), [
    ({"target_modules": ["embed_tokens"]}, "not a LoRA A/B weight of a Linear layer"),
    ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "save whole modules"),
    ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
])
def test_adapters_the_engine_cannot_serve_are_refused(config: dict, message: str, engine: EngineProcess,
                                                      tiny_model_dir: Path, tmp_path: Path) -> None:
    _peft_adapter(tiny_model_dir, tmp_path / "odd", seed=4, r=2, lora_alpha=2, **config)
    answer = httpx.post(f"{engine.url}/load_lora_adapter",
                        json={"lora_name": "odd", "lora_path": str(tmp_path / "odd")})
    assert answer.status_code == 400
    assert answer.json()["success"] is False and message in answer.json()["error_message"]


def test_bad_adapter_requests_get_sglangs_errors(engine: EngineProcess, tiny_model_dir: Path,
                                                 tmp_path: Path) -> None:
    missing = httpx.post(f"{engine.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and "not a PEFT adapter directory" in missing.json()["error_message"]
    _peft_adapter(tiny_model_dir, tmp_path / "x", seed=5, r=2, lora_alpha=2, target_modules=["q_proj"])
    first = httpx.post(f"{engine.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "x")})
    again = httpx.post(f"{engine.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "x")})
    assert first.status_code == 200 and again.status_code == 400
    assert again.json()["error_message"] == "Failed to load LoRA adapter x because it is already loaded"
    assert httpx.post(f"{engine.url}/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    gone = httpx.post(f"{engine.url}/unload_lora_adapter", json={"lora_name": "x"})
    assert gone.status_code == 400 and "LoRA with name x does not exist" in gone.json()["error_message"]
    unknown = httpx.post(f"{engine.url}/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
    assert unknown.status_code == 400
    assert "The following requested LoRA adapters are not loaded: nope" in unknown.json()["error"]["message"]


def test_an_engine_without_enable_lora_refuses_adapters(engine_url: str, tmp_path: Path) -> None:
    generate = httpx.post(f"{engine_url}/generate", json={"input_ids": PROMPT, "lora_path": "a"})
    assert generate.status_code == 400 and "LoRA is not enabled" in generate.json()["error"]["message"]
    load = httpx.post(f"{engine_url}/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
    assert load.status_code == 400 and "--enable_lora" in load.json()["error_message"]


async def test_a_vision_language_models_adapters_see_the_pictures(launch_engine: Callable[..., EngineProcess],
                                                                  tmp_path: Path) -> None:
    """A tiny Qwen2.5-VL served with ``--enable_lora``: a request with a picture and an adapter of the language model
    gets PEFT's merged model's greedy tokens and logprobs on that picture, in the same batch as a base-model
    request on it (one encoding of the picture serves both); an adapter of a vision-tower layer is refused."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from agentrl.inference.tiny_model import build_tiny_vision_model
    from inference_fixtures import picture
    from test_inference_vision import QUESTION, data_uri, prompt_ids, reference

    model_dir = build_tiny_vision_model(tmp_path / "vlm")
    torch.manual_seed(6)
    peft = get_peft_model(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(tmp_path / "seeing")
    models = {"seeing": peft.merge_and_unload().eval(),
              None: AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()}
    image = picture(4)
    ids = prompt_ids(model_dir, QUESTION, [image], expand=True)
    expected = {name: reference(model_dir, ids, [image], 10, model=model) for name, model in models.items()}
    assert expected["seeing"][0] != expected[None][0]  # the adapter changes what the model says

    torch.manual_seed(7)
    tower = get_peft_model(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(init_lora_weights=False, r=2, lora_alpha=2, target_modules=["gate_proj"]))
    tower.save_pretrained(tmp_path / "tower")  # Qwen2.5-VL's vision blocks have a gate_proj too
    engine = launch_engine(model_dir, "--enable_lora")
    try:
        async with SGLangClient(engine.url) as client:
            await client.load_lora_adapter("seeing", str(tmp_path / "seeing"))
            body = {"input_ids": ids, "image_data": [data_uri(image)], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
            async with httpx.AsyncClient(base_url=engine.url, timeout=120) as http:
                answers = await asyncio.gather(*(http.post("/generate", json={**body, "lora_path": name})
                                                 for name in ("seeing", None)))
                alone = [(await http.post("/generate", json={**body, "lora_path": "seeing"})).json()
                         for _ in range(3)]  # one at a time: the same bits each time
                refused = await http.post("/load_lora_adapter", json={"lora_name": "tower",
                                                                      "lora_path": str(tmp_path / "tower")})
    finally:
        assert engine.stop() == 0, engine.output
    for name, answer in zip(("seeing", None), answers, strict=True):
        assert answer.status_code == 200, answer.text
        payload = answer.json()
        tokens, logprobs = expected[name]
        assert payload["output_ids"] == tokens, name
        got = [entry[0] for entry in payload["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4, name
    for payload in alone[1:]:  # (batched with a base request, its logprobs differ from these by ~1e-6: routed rows)
        assert payload["output_ids"] == alone[0]["output_ids"] == answers[0].json()["output_ids"]
        assert payload["meta_info"]["output_token_logprobs"] == alone[0]["meta_info"]["output_token_logprobs"]
    assert refused.status_code == 400 and "is in the vision tower" in refused.json()["error_message"], refused.text
