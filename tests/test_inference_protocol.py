"""Contract of the wire format: SGLang's names, defaults and shapes (io_struct.py, sampling_params.py, v0.5.x)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.inference.client import GenerateResult
from agentrl.inference.protocol import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
)

# A /generate response as SGLang v0.5 returns it (tokenizer_manager.py meta_info, plus keys we do not produce).
SGLANG_RESPONSE = {
    "text": " 5",
    "output_ids": [220, 20, 2],
    "meta_info": {
        "id": "d6f1c0",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 12,
        "weight_version": "default",
        "total_retractions": 0,
        "completion_tokens": 3,
        "cached_tokens": 8,
        "e2e_latency": 0.05,
        "output_token_logprobs": [[-0.5, 220, None], [-0.25, 20, None], [-0.125, 2, None]],
    },
}


def test_sampling_param_defaults_are_sglangs() -> None:
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (
        128, 1.0, 1.0, -1, 0.0)
    assert params.stop is None and params.stop_token_ids is None and params.ignore_eos is False
    assert params.skip_special_tokens is True and params.sampling_seed is None
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"temperature": float("inf")}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0},
    {"top_k": -2}, {"min_p": 1.5}, {"max_new_tokens": -1}, {"n": 2}, {"seed": 3}, {"frequency_penalty": 2.5},
    {"presence_penalty": -3}, {"repetition_penalty": 0},
])
def test_invalid_sampling_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(bad)


@pytest.mark.parametrize("body", [
    {}, {"input_ids": []}, {"input_ids": [1, -2]}, {"input_ids": [[1, 2], [3]]}, {"text": "a", "input_ids": [1]},
    {"input_ids": [1], "stream": True}, {"input_ids": [1], "top_logprobs_num": 2},
    {"input_ids": [1], "logprob_start_len": -2}, {"input_ids": [1], "unknown": 1},
])
def test_invalid_generate_requests_are_rejected(body: dict) -> None:
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(body)


def test_generate_request_accepts_sglang_fields() -> None:
    request = GenerateRequest.model_validate({
        "input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0,
        "return_text_in_logprobs": False, "stream": False, "rid": "r1",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                            "stop": ["</tool_call>"], "stop_token_ids": [2], "ignore_eos": False,
                            "skip_special_tokens": True, "no_stop_trim": False, "sampling_seed": 11, "n": 1}})
    assert request.sampling_params.stop_strings == ["</tool_call>"]


def test_sglang_response_parses_into_a_result() -> None:
    result = GenerateResult.from_response(GenerateResponse.model_validate(SGLANG_RESPONSE))
    assert result.output_ids == [220, 20, 2]
    assert result.output_token_logprobs == [-0.5, -0.25, -0.125]
    assert (result.finish_reason, result.matched_stop) == ("stop", 2)
    assert (result.prompt_tokens, result.completion_tokens, result.weight_version) == (12, 3, "default")
    assert result.meta_info["total_retractions"] == 0  # keys we do not model are kept


def test_finish_reasons_serialise_like_sglang() -> None:
    assert FinishReason(type="length", length=16).model_dump() == {"type": "length", "length": 16}
    assert FinishReason(type="stop", matched=2).model_dump() == {"type": "stop", "matched": 2}
    assert FinishReason(type="stop", matched="</s>").model_dump() == {"type": "stop", "matched": "</s>"}


def test_update_weights_request_shape() -> None:
    request = UpdateWeightsFromDiskRequest.model_validate({"model_path": "/ckpt/step-3", "weight_version": 3})
    assert request.weight_version == "3" and request.flush_cache is True and request.abort_all_requests is False
    with pytest.raises(ValidationError):
        UpdateWeightsFromDiskRequest.model_validate({"model_path": ""})
    with pytest.raises(ValidationError):
        UpdateWeightsFromDiskRequest.model_validate({"model_path": "/x", "bogus": True})
