"""Contract with SGLang's own source: every key our client sends is one SGLang accepts, our response models read
only keys SGLang produces, and the engine's and the stand-in's routes are SGLang's.

The facts come from ``tests/contracts/sglang_api.json``, extracted from SGLang's source by
``tests/contracts/extract_sglang_api.py`` (not run here: CI has no SGLang source). What the client sends is
captured by a real HTTP server, the SGLang stand-in (``tests/sglang_standin.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

from agentrl.inference import SGLangClient
from agentrl.inference.protocol import (
    EXTENSIONS,
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    MemoryOccupationRequest,
    MetaInfo,
    ModelInfo,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    WeightUpdateResponse,
    policy_version,
)
from agentrl.inference.server import create_app
from sglang_standin import StandInProcess, StandInSettings
from sglang_standin import create_app as create_standin_app

CONTRACT = json.loads((Path(__file__).parent / "contracts" / "sglang_api.json").read_text())
API = CONTRACT["api_v1"]
QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5,
                  "repetition_penalty": 1.05}


def sampling_fields() -> set[str]:
    """Keys SGLang accepts in ``sampling_params``: SamplingParams' arguments that its contract gate also admits."""
    return set(CONTRACT["sampling_params"]["fields"]) & set(API["SamplingParams"]["fields"])


def fields(model: type) -> set[str]:
    return set(model.model_fields)


@pytest.fixture
def standin() -> Iterator[StandInProcess]:
    with StandInProcess([11, 12, 2], "ok", QWEN3_DEFAULTS) as server:
        yield server


def test_fixture_names_its_source() -> None:
    source = CONTRACT["source"]
    assert source["package_version"] or source["git_commit"]
    assert "sglang/srt/managers/io_struct.py" in source["files"]
    assert API["SamplingParams"]["unknown_keys"] == "rejected"  # a misspelt sampling parameter is a 400
    assert CONTRACT["weight_version_default"] == "default"
    assert CONTRACT["preferred_sampling_params_merge"] == "{**self.preferred_sampling_params, **obj.sampling_params}"


def test_request_models_use_only_fields_sglang_accepts() -> None:
    assert fields(GenerateRequest) <= set(CONTRACT["generate_request_fields"]) & set(API["GenerateRequest"]["fields"])
    assert fields(SamplingParams) <= sampling_fields()
    assert fields(UpdateWeightsFromDiskRequest) <= set(CONTRACT["update_weights_from_disk"]["request_fields"])
    occupation = CONTRACT["memory_occupation_request_fields"]
    assert fields(MemoryOccupationRequest) <= set(occupation["release"]) & set(occupation["resume"])


def test_lora_adapter_requests_and_answers_are_sglangs() -> None:
    lora = CONTRACT["lora"]
    assert fields(LoadLoRAAdapterRequest) <= set(lora["load_request_fields"])
    assert fields(UnloadLoRAAdapterRequest) <= set(lora["unload_request_fields"])
    assert fields(LoRAUpdateResponse) == set(lora["update_output_fields"]) - {"rid", "http_worker_ipc"}
    assert "lora_path" in fields(GenerateRequest)
    assert {"/load_lora_adapter", "/unload_lora_adapter"} <= set(CONTRACT["routes"])


def test_weight_update_group_requests_and_answers_are_sglangs() -> None:
    """Field names and defaults of SGLang's weight-update-group structs (a trainer written for SGLang sends these
    bodies unchanged), their answers, and the routes."""
    group = CONTRACT["weight_update_group"]
    for model, struct in ((InitWeightsUpdateGroupRequest, "init_request"),
                          (UpdateWeightsFromDistributedRequest, "update_request"),
                          (DestroyWeightsUpdateGroupRequest, "destroy_request")):
        assert fields(model) == set(group[struct]) - {"rid", "http_worker_ipc"}, model
        for name, field in model.model_fields.items():
            if group[struct][name] is not None:
                assert field.default == group[struct][name], (model, name)
    for path, keys in group["response_keys"].items():
        assert set(keys) == fields(WeightUpdateResponse), path
        assert path in CONTRACT["routes"]
    assert group["distributed_load_formats"] == ["direct", "flattened_bucket"]
    assert group["bucket_element_views"] == ["torch.uint8"]


def test_sampling_defaults_are_sglangs() -> None:
    sglang = CONTRACT["sampling_params"]["defaults"]
    ours = SamplingParams()
    for name in fields(SamplingParams) - {"top_k", "stop_token_ids"}:
        assert getattr(ours, name) == sglang[name], name
    assert ours.top_k == -1 and sglang["top_k"] == "TOP_K_ALL"  # SGLang maps -1 to TOP_K_ALL
    assert ours.stop_token_ids is None and sglang["stop_token_ids"] is None


def test_response_models_read_only_keys_sglang_produces() -> None:
    meta_keys = set(CONTRACT["meta_info_keys"]) | set(API["GenerateMetaInfo"]["fields"])
    assert fields(MetaInfo) - EXTENSIONS <= meta_keys and not EXTENSIONS & meta_keys  # ours never clash with SGLang's
    assert fields(GenerateResponse) <= set(API["GenerateResponse"]["fields"])
    finish = CONTRACT["finish_reasons"]
    assert set(FinishReason.model_fields["type"].annotation.__args__) == set(finish)
    assert fields(FinishReason) <= set().union(*finish.values())
    assert fields(ModelInfo) <= set(CONTRACT["model_info_keys"])
    assert fields(UpdateWeightsFromDiskResponse) == set(CONTRACT["update_weights_from_disk"]["response_keys"])


@pytest.mark.parametrize("app", ["engine", "standin"])
def test_routes_are_sglangs(app: str) -> None:
    served = (create_app(None) if app == "engine"  # type: ignore[arg-type]  # routes only; nothing is served
              else create_standin_app(StandInSettings(reply_ids=[1])))
    routes = [r for r in served.routes if isinstance(r, APIRoute) and r.path != "/debug/requests"]
    assert {"/generate", "/health", "/get_model_info", "/update_weights_from_disk", "/flush_cache"} <= {
        r.path for r in routes}
    if app == "engine":
        assert {"/load_lora_adapter", "/unload_lora_adapter"} <= {r.path for r in routes}
    for route in routes:
        assert route.path in CONTRACT["routes"], route.path
        assert route.methods <= set(CONTRACT["routes"][route.path]), (route.path, route.methods)


async def test_client_sends_every_sampling_parameter_and_only_sglang_keys(standin: StandInProcess) -> None:
    async with SGLangClient(standin.url) as client:
        info = await client.get_model_info()
        assert info.preferred_sampling_params == QWEN3_DEFAULTS and info.weight_version == "default"
        first = await client.generate([1, 2, 3], {"max_new_tokens": 8, "stop": ["</tool_call>"],
                                                  "stop_token_ids": [2], "sampling_seed": 5}, rid="r1")
        await client.update_weights_from_disk("/ckpt/step-3", weight_version=3)
        second = await client.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0.0})
        await client.release_memory_occupation(["kv_cache"])
        await client.resume_memory_occupation(["kv_cache"])

    generate = standin.requests("/generate")
    for request in generate:
        assert set(request["body"]) <= set(CONTRACT["generate_request_fields"])
        assert set(request["body"]["sampling_params"]) <= sampling_fields()
        # every parameter that shapes the distribution is sent: the server's Qwen3 defaults never apply
        assert request["sampling_params_used"]["top_p"] == 1.0 and request["sampling_params_used"]["top_k"] == -1
        assert request["sampling_params_used"]["repetition_penalty"] == 1.0
        assert request["sampling_params_used"]["presence_penalty"] == 0.0
    assert generate[0]["sampling_params_used"]["temperature"] == 1.0
    assert first.output_token_logprobs == [-1.0, -1.0, -1.0]  # the stand-in's logprob shows the temperature used
    assert generate[1]["sampling_params_used"]["temperature"] == 0.0
    [update] = standin.requests("/update_weights_from_disk")
    assert set(update["body"]) <= set(CONTRACT["update_weights_from_disk"]["request_fields"])
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        [memory] = standin.requests(path)
        assert set(memory["body"]) <= set(CONTRACT["memory_occupation_request_fields"]["release"])
    # SGLang's "default" weight version is the run's initial policy; published versions are numbers
    assert (first.weight_version, second.weight_version) == ("default", "3")
    assert (policy_version(first.weight_version), policy_version(second.weight_version)) == (0, 3)
    assert set(first.meta_info) <= set(CONTRACT["meta_info_keys"]) | set(API["GenerateMetaInfo"]["fields"])


def test_standin_answers_in_sglangs_shapes(standin: StandInProcess) -> None:
    info = httpx.get(f"{standin.url}/get_model_info").json()
    assert set(info) == set(CONTRACT["model_info_keys"])
    generated = httpx.post(f"{standin.url}/generate", json={
        "input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}).json()
    assert set(generated) <= set(API["GenerateResponse"]["fields"])
    assert set(generated["meta_info"]) <= set(CONTRACT["meta_info_keys"])
    finish = generated["meta_info"]["finish_reason"]
    assert set(finish) <= set(CONTRACT["finish_reasons"][finish["type"]])
    misspelt = httpx.post(f"{standin.url}/generate", json={"input_ids": [1], "sampling_params": {"temprature": 1}})
    assert misspelt.status_code == 400 and "temprature" in misspelt.json()["error"]["message"]
    updated = httpx.post(f"{standin.url}/update_weights_from_disk", json={"model_path": "/ckpt", "weight_version": "1"})
    assert set(updated.json()) == set(CONTRACT["update_weights_from_disk"]["response_keys"])


def test_non_numeric_weight_versions_are_the_initial_policy() -> None:
    assert [policy_version(v) for v in ("default", None, "v7", "0", "12")] == [0, 0, 0, 0, 12]
