"""Async client for SGLang's native HTTP API (and the ``agentrl engine``, which speaks the same subset).

Token ids in, token ids and per-token logprobs out (docs/inference-protocol.md). Request and response shapes are those
of :mod:`agentrl.inference.protocol` (taken from SGLang's ``io_struct.py`` and ``http_server.py``, 0.5.23). Every
sampling parameter is sent, defaults included: SGLang fills an omitted one from the server's preferred sampling params
(``--preferred-sampling-params``), which would silently change the sampling distribution.

Transient failures (connection refused or reset, HTTP 429/502/503/504, and timeouts of calls that are safe to
repeat) are retried with exponential backoff and jitter; every error names the service URL, the endpoint and
the cause.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, Field

from agentrl.inference.protocol import (
    DEFAULT_GROUP,
    EXTENSIONS,
    GenerateResponse,
    LoRAUpdateResponse,
    ModelInfo,
    SamplingParams,
    UpdateWeightsFromDiskResponse,
    WeightUpdateResponse,
    adapter_policy_version,
    policy_version,
)

WeightUpdateAnswer = TypeVar("WeightUpdateAnswer", UpdateWeightsFromDiskResponse, WeightUpdateResponse)

logger = logging.getLogger(__name__)

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
API_KEY_ENV = "AGENTRL_INFERENCE_API_KEY"
"""The environment variable holding the inference services' API key (``agentrl engine --api_key``, SGLang's
``--api-key``): every client sends it as ``Authorization: Bearer KEY`` when it is set."""


class InferenceServiceError(RuntimeError):
    """A call to an inference service failed; ``transient`` says whether another try (or service) may work."""

    def __init__(self, base_url: str, endpoint: str, cause: str, *, status_code: int | None = None,
                 transient: bool = False):
        self.base_url, self.endpoint, self.cause = base_url, endpoint, cause
        self.status_code, self.transient = status_code, transient
        status = f" (HTTP {status_code})" if status_code is not None else ""
        super().__init__(f"inference service {base_url}{endpoint} failed{status}: {cause}")


class InferenceRequestError(InferenceServiceError):
    """The service rejected the request itself (HTTP 4xx other than 429): retrying it cannot help."""


class GenerateResult(BaseModel):
    """One generation: the sampled token ids, their logprobs and why generation stopped."""

    output_ids: list[int]
    text: str
    output_token_logprobs: list[float] = Field(
        default_factory=list,
        description="logprob of each output token, log_softmax((logits - penalties) / temperature)")
    finish_reason: str = Field(description="stop, length or abort")
    matched_stop: int | str | None = Field(None, description="the stop token id or string that matched")
    prompt_tokens: int
    completion_tokens: int
    input_token_logprobs: list[float | None] = Field(
        default_factory=list, description="logprobs of the prompt tokens from logprob_start_len on (the first: None)")
    weight_version: str | None = Field(None, description="version of the weights that produced the output (its "
                                       "last token's)")
    weight_version_spans: list[tuple[str, int]] | None = Field(
        None, description="[version, tokens] in order when the output spans several weight versions")
    lora_path: str | None = Field(None, description="the LoRA adapter the request named, if any")
    meta_info: dict[str, Any] = Field(default_factory=dict, description="the raw meta_info, all keys")

    @property
    def policy_version(self) -> int:
        """The run's policy version of the output: the adapter's (SGLang keeps ``weight_version`` across adapter
        loads), else the service's weight version."""
        version = adapter_policy_version(self.lora_path) if self.lora_path else None
        return version if version is not None else policy_version(self.weight_version)

    @property
    def policy_version_spans(self) -> list[tuple[int, int]]:
        """``(policy version, tokens)`` runs of the output in order: one run of :attr:`policy_version` unless the
        service swapped base weights while generating (an adapter's tokens all have the adapter's version)."""
        if self.weight_version_spans and not self.lora_path:
            return [(policy_version(version), tokens) for version, tokens in self.weight_version_spans]
        return [(self.policy_version, len(self.output_ids))]

    @classmethod
    def from_response(cls, response: GenerateResponse) -> GenerateResult:
        meta = response.meta_info
        finish = meta.finish_reason
        return cls(
            output_ids=response.output_ids, text=response.text,
            output_token_logprobs=[float(entry[0]) for entry in meta.output_token_logprobs or []],
            input_token_logprobs=[None if entry[0] is None else float(entry[0])
                                  for entry in meta.input_token_logprobs or []],
            finish_reason=finish.type if finish else "abort", matched_stop=finish.matched if finish else None,
            prompt_tokens=meta.prompt_tokens, completion_tokens=meta.completion_tokens,
            weight_version=meta.weight_version, weight_version_spans=meta.weight_version_spans,
            meta_info=meta.model_dump(mode="json", exclude=None if meta.weight_version_spans else EXTENSIONS))


class SGLangClient:
    """Client of one SGLang-compatible service. Use ``async with SGLangClient(url) as client:`` or ``close()``.

    ``timeout_s`` bounds every call except weight updates and memory release/resume, which wait for running
    requests to finish and use ``admin_timeout_s``. ``max_retries`` more attempts follow a transient failure,
    waiting ``backoff_s * 2**attempt`` (capped at ``max_backoff_s``) with ±50% jitter. ``api_key`` (default:
    ``$AGENTRL_INFERENCE_API_KEY``) is sent as ``Authorization: Bearer`` with every call.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, admin_timeout_s: float = 1800.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s, self.admin_timeout_s = timeout_s, admin_timeout_s
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        api_key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # -------------------------------------------------------------------------------------------------- calls

    async def generate(self, input_ids: Sequence[int], sampling_params: SamplingParams | dict[str, Any] | None = None,
                       *, return_logprob: bool = True, rid: str | None = None,
                       lora_path: str | None = None, logprob_start_len: int | None = None,
                       image_data: Sequence[str] | None = None) -> GenerateResult:
        """``POST /generate`` with token ids; ``sampling_params`` uses SGLang's names (see ``SamplingParams``) and
        is sent in full, so the server's preferred defaults never apply. ``lora_path`` names a loaded adapter;
        ``logprob_start_len`` asks for the prompt tokens' logprobs from that position on; ``image_data`` are the
        prompt's images in order (data: URIs; the ids hold their expanded ``<|image_pad|>`` runs)."""
        params = (sampling_params if isinstance(sampling_params, SamplingParams)
                  else SamplingParams.model_validate(sampling_params or {}))
        body: dict[str, Any] = {"input_ids": list(input_ids),
                                "sampling_params": params.wire(),
                                "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if image_data:
            body["image_data"] = list(image_data)
        response = await self._request("POST", "/generate", json=body, retry_timeouts=False)
        payload = self._json(response, "/generate")
        try:
            parsed = GenerateResponse.model_validate(payload)
        except ValueError as error:
            raise InferenceServiceError(self.base_url, "/generate", f"unexpected response shape: {error}") from error
        result = GenerateResult.from_response(parsed)
        result.lora_path = lora_path
        return result

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | int | None = None,
                                       flush_cache: bool = True) -> UpdateWeightsFromDiskResponse:
        """``POST /update_weights_from_disk``; raises :class:`InferenceRequestError` when the service refuses."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._weight_update("/update_weights_from_disk", body, UpdateWeightsFromDiskResponse)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> WeightUpdateResponse:
        """``POST /init_weights_update_group`` (answers once every member joined: call it while rank 0 joins);
        raises :class:`InferenceRequestError` when the service refuses."""
        return await self._weight_update("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = DEFAULT_GROUP, weight_version: str | int | None = None,
                                              load_format: str | None = None, flush_cache: bool = True
                                              ) -> WeightUpdateResponse:
        """``POST /update_weights_from_distributed`` (answers once rank 0's broadcast of these tensors arrived);
        raises :class:`InferenceRequestError` when the service refuses."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weight_update("/update_weights_from_distributed", body)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *,
                                         weight_version: str | int | None = None, load_format: str | None = None,
                                         flush_cache: bool = True) -> WeightUpdateResponse:
        """``POST /update_weights_from_tensor`` (tensors shared from this host:
        :mod:`agentrl.inference.tensor_payload`); raises :class:`InferenceRequestError` when the service refuses."""
        body: dict[str, Any] = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weight_update("/update_weights_from_tensor", body)

    async def begin_weight_update(self) -> WeightUpdateResponse:
        """``POST /begin_weight_update``: open the weight-update session SGLang (0.5.23 on) wants around
        ``/update_weights_from_distributed`` calls; raises :class:`InferenceRequestError` when the service refuses
        (404: a service without sessions)."""
        return await self._weight_update("/begin_weight_update", {})

    async def end_weight_update(self) -> WeightUpdateResponse:
        """``POST /end_weight_update``: close the session; raises :class:`InferenceRequestError` when refused."""
        return await self._weight_update("/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> WeightUpdateResponse:
        """``POST /destroy_weights_update_group``; raises :class:`InferenceRequestError` when the service refuses."""
        return await self._weight_update("/destroy_weights_update_group", {"group_name": group_name})

    async def _weight_update(self, endpoint: str, body: dict[str, Any],
                             answer: type[WeightUpdateAnswer] = WeightUpdateResponse) -> WeightUpdateAnswer:
        """An admin weight call answering SGLang's ``{success, message, ...}``; raises when it is refused."""
        response = await self._request("POST", endpoint, json=body, timeout=self.admin_timeout_s,
                                       retry_timeouts=False, raise_for_status=False)
        payload = self._json(response, endpoint)
        result = answer.model_validate(payload) if "success" in payload else None
        if result is None or not result.success or response.status_code >= 400:
            cause = result.message if result is not None else _error_message(response)
            raise InferenceRequestError(self.base_url, endpoint, cause, status_code=response.status_code)
        return result

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAUpdateResponse:
        """``POST /load_lora_adapter``; raises :class:`InferenceRequestError` when the service refuses."""
        return await self._lora_update("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateResponse:
        """``POST /unload_lora_adapter`` (answers once no running request uses it); raises when refused."""
        return await self._lora_update("/unload_lora_adapter", {"lora_name": lora_name})

    async def _lora_update(self, endpoint: str, body: dict[str, Any]) -> LoRAUpdateResponse:
        response = await self._request("POST", endpoint, json=body, timeout=self.admin_timeout_s,
                                       retry_timeouts=False, raise_for_status=False)
        payload = self._json(response, endpoint)
        result = LoRAUpdateResponse.model_validate(payload) if "success" in payload else None
        if result is None or not result.success or response.status_code >= 400:
            cause = (result.error_message or "refused") if result is not None else _error_message(response)
            raise InferenceRequestError(self.base_url, endpoint, cause, status_code=response.status_code)
        return result

    async def health(self) -> bool:
        """``GET /health``: true on 200; false when the service answers otherwise or cannot be reached."""
        return await self._probe("/health")

    async def health_generate(self) -> bool:
        """``GET /health_generate`` (generates one token): true on 200."""
        return await self._probe("/health_generate")

    async def get_model_info(self) -> ModelInfo:
        response = await self._request("GET", "/get_model_info", retry_timeouts=True)
        return ModelInfo.model_validate(self._json(response, "/get_model_info"))

    async def flush_cache(self) -> bool:
        """``POST /flush_cache``: true when flushed, false when the service refused (requests were running)."""
        response = await self._request("POST", "/flush_cache", retry_timeouts=True, raise_for_status=False)
        if response.status_code not in (200, 400):
            raise InferenceServiceError(self.base_url, "/flush_cache", response.text[:500],
                                        status_code=response.status_code)
        return response.status_code == 200

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``POST /release_memory_occupation`` (colocated layout: free GPU memory for training)."""
        await self._request("POST", "/release_memory_occupation", json={"tags": tags} if tags else {},
                            timeout=self.admin_timeout_s, retry_timeouts=False)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """``POST /resume_memory_occupation``."""
        await self._request("POST", "/resume_memory_occupation", json={"tags": tags} if tags else {},
                            timeout=self.admin_timeout_s, retry_timeouts=False)

    # ---------------------------------------------------------------------------------------------- transport

    async def _probe(self, endpoint: str) -> bool:
        try:
            response = await self._http.get(endpoint)
        except httpx.HTTPError as error:
            logger.debug("%s%s unreachable: %s", self.base_url, endpoint, error)
            return False
        return response.status_code == 200

    async def _request(self, method: str, endpoint: str, *, json: Any = None, timeout: float | None = None,
                       retry_timeouts: bool, raise_for_status: bool = True) -> httpx.Response:
        """Send with retries on transient failures; raise :class:`InferenceServiceError` naming the cause."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    method, endpoint, json=json, timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            except httpx.TimeoutException as error:
                failure = InferenceServiceError(
                    self.base_url, endpoint, f"timed out ({type(error).__name__})", transient=True)
                if not retry_timeouts and not isinstance(error, httpx.ConnectTimeout):
                    raise failure from error
            except httpx.TransportError as error:
                failure = InferenceServiceError(
                    self.base_url, endpoint, f"{type(error).__name__}: {error or 'connection failed'}", transient=True)
            else:
                if response.status_code in TRANSIENT_STATUS:
                    failure = InferenceServiceError(self.base_url, endpoint, _error_message(response),
                                                    status_code=response.status_code, transient=True)
                elif raise_for_status and response.status_code >= 400:
                    kind = InferenceRequestError if response.status_code < 500 else InferenceServiceError
                    raise kind(self.base_url, endpoint, _error_message(response), status_code=response.status_code)
                else:
                    return response
            if attempt >= self.max_retries:
                raise failure
            delay = min(self.backoff_s * 2 ** attempt, self.max_backoff_s) * random.uniform(0.5, 1.5)
            logger.warning("%s; retrying in %.1fs (attempt %d of %d)", failure, delay, attempt + 2,
                           self.max_retries + 1)
            attempt += 1
            await asyncio.sleep(delay)

    def _json(self, response: httpx.Response, endpoint: str) -> Any:
        try:
            return response.json()
        except ValueError as error:
            raise InferenceServiceError(self.base_url, endpoint, f"response is not JSON: {response.text[:200]!r}",
                                        status_code=response.status_code) from error


def _error_message(response: httpx.Response) -> str:
    """The message of an SGLang/OpenAI error body, else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]
