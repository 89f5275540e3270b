"""Wire format of the SGLang native API subset we use (docs/inference-protocol.md), shared by the client and the engine.

Names, defaults and shapes follow SGLang's source (SGLang 0.5.23; the facts are pinned in
``tests/contracts/sglang_api.json``, extracted by ``tests/contracts/extract_sglang_api.py``):

* ``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput`` (``text``/``input_ids``, ``sampling_params``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``stream``,
  ``rid``), ``UpdateWeightFromDiskReqInput`` (``model_path``, ``load_format``, ``abort_all_requests``,
  ``weight_version``, ``flush_cache``) and its output (``success``, ``message``, ``num_paused_requests``),
  ``Release/ResumeMemoryOccupationReqInput`` (``tags``), ``Load/UnloadLoRAAdapterReqInput`` (``lora_name``,
  ``lora_path``, ``pinned``) and their output ``LoRAUpdateOutput`` (``success``, ``error_message``,
  ``loaded_adapters``: name -> path); a ``/generate`` request names its adapter in ``lora_path`` (the adapter's
  *name*, as loaded); adapter loads leave ``weight_version`` unchanged;
* ``python/sglang/srt/sampling/sampling_params.py``: ``SamplingParams`` fields, defaults (``max_new_tokens=128``,
  ``temperature=1``, ``top_p=1``, ``top_k=-1`` (all), ``min_p=0``, ``presence_penalty=0``,
  ``frequency_penalty=0``, ``repetition_penalty=1``) and the checks of ``verify()``; ``python/sglang/api/v1/
  api_types.py`` rejects any other ``sampling_params`` key with a 400;
* ``python/sglang/srt/managers/tokenizer_manager.py``: ``meta_info`` keys (``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``e2e_latency``,
  ``output_token_logprobs`` as ``[logprob, token_id, text-or-null]`` triples; ``input_token_logprobs``, the same
  triples for the prompt tokens from ``logprob_start_len`` on, the first one's logprob null: the scheduler's
  ``_process_input_token_logprobs`` in ``scheduler_output_processor_mixin.py``; ``logprob_start_len`` -1 means the
  last prompt token, and a start at or past the prompt's end is a 400). A server started with
  ``--preferred-sampling-params`` fills every parameter a request *omits* from those
  (``{**preferred_sampling_params, **obj.sampling_params}``), so clients send every parameter they rely on;
  ``weight_version`` is ``"default"`` until a weight update names one;
* ``python/sglang/srt/managers/schedule_batch.py``: finish reasons ``{"type": "stop", "matched": id-or-str}``,
  ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``;
* ``python/sglang/srt/entrypoints/http_server.py``: endpoints, status codes (400 on a bad request or a failed
  weight update) and the error body ``{"error": {"message": ...}}``; ``/get_model_info`` reports
  ``preferred_sampling_params`` as a JSON object (older releases: the JSON string).

The request models reject unknown fields, so a misspelt or unsupported parameter is a 400, not silently ignored.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

logger = logging.getLogger(__name__)

# SGLang's TOP_K_ALL sentinel is -1 on the wire.
TOP_K_ALL = -1
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
INITIAL_POLICY_VERSION = 0
DEFAULT_GROUP = "weight_update_group"
"""SGLang's default weight-update group name."""
_non_numeric_versions_seen: set[str | None] = set()


def policy_version(weight_version: str | None) -> int:
    """The run's policy version of a service's ``weight_version``.

    Numeric versions are the trainer's (it publishes ``"1"``, ``"2"``, ...). Anything else, SGLang's ``"default"``
    before any update included, is the weights the service started with: the run's initial policy, version 0.
    """
    if weight_version is not None and weight_version.isdigit():
        return int(weight_version)
    if weight_version not in _non_numeric_versions_seen:
        _non_numeric_versions_seen.add(weight_version)
        logger.debug("weight_version %r is not a number: counted as the initial policy (version %d)",
                     weight_version, INITIAL_POLICY_VERSION)
    return INITIAL_POLICY_VERSION


def policy_adapter_name(version: int) -> str:
    """The name under which the trainer publishes the adapter of policy ``version`` (``--lora_publish adapter``)."""
    return f"policy-v{version}"


def adapter_policy_version(name: str) -> int | None:
    """The policy version of an adapter named by :func:`policy_adapter_name`; ``None`` for any other name."""
    prefix = "policy-v"
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None



class BadRequest(ValueError):
    """The request cannot be served as asked (answered with HTTP 400 and this message)."""

class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Request):
    """SGLang ``sampling_params`` (the subset the agentrl engine implements)."""

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(TOP_K_ALL, description="-1 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                    description="subtracted from the logit of every token generated so far")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                     description="subtracted once per earlier occurrence in the generated tokens")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0,
                                      description="1 disables it (the agentrl engine supports only 1)")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = Field(False, description="as in SGLang, also ignores stop_token_ids")
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(None, description="makes the request reproducible")
    n: int = Field(1, ge=1, le=1, description="only 1: send n requests instead")

    @field_validator("temperature")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"temperature must be a non-negative finite number, got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value != TOP_K_ALL and value < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {value}")
        return value

    def wire(self) -> dict[str, Any]:
        """Every parameter that is set, defaults included: a server's preferred defaults must never apply."""
        return self.model_dump(exclude_none=True)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateRequest(_Request):
    """Body of ``POST /generate`` (one prompt; SGLang's batched form is not supported)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int | None = Field(
        None, ge=-1, description="with return_logprob, the first prompt position whose token's logprob is returned in "
        "input_token_logprobs (its own is null, as in SGLang); -1 (default): the last prompt token only")
    top_logprobs_num: int | None = Field(None, description="only 0 is supported")
    return_text_in_logprobs: bool = False
    stream: Literal[False] = False
    rid: str | None = None
    lora_path: str | None = Field(None, description="name of a loaded LoRA adapter to generate with")
    image_data: str | list[str] | None = Field(
        None, description="the prompt's images in order, each a data: URI or base64 (SGLang's image_data for one "
        "prompt); the prompt marks each with <|vision_start|><|image_pad|><|vision_end|>, its <|image_pad|> once or "
        "already expanded to the image's token count")

    def images(self) -> list[str]:
        """``image_data`` as a list (SGLang takes one image as a plain string)."""
        if self.image_data is None:
            return []
        return [self.image_data] if isinstance(self.image_data, str) else list(self.image_data)

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty")
        if self.input_ids is not None and min(self.input_ids) < 0:
            raise ValueError(f"input_ids contains a negative token id ({min(self.input_ids)})")
        if self.top_logprobs_num not in (None, 0):
            raise ValueError("top_logprobs_num: only 0 is supported")
        return self


class FinishReason(BaseModel):
    """Why generation stopped: ``stop`` (a stop token or string matched), ``length`` or ``abort``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


EXTENSIONS = {"weight_version_spans"}
"""``meta_info`` keys the ``agentrl engine`` adds to SGLang's (only when it has something to say)."""


class MetaInfo(BaseModel):
    """``meta_info`` of a ``/generate`` response (extra keys that SGLang adds are kept)."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = Field(None, description="the weight version of the last output token")
    weight_version_spans: list[tuple[str, int]] | None = Field(
        None, description="agentrl engine only, when the output spans several weight versions (weights swapped "
        "while it ran): [version, tokens] in order; absent: every token has weight_version")
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = Field(
        None, description="[logprob, token id, text] of the prompt tokens from logprob_start_len on (the first: null)")


class GenerateResponse(BaseModel):
    """Body of a ``/generate`` response."""

    model_config = ConfigDict(extra="allow")

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class UpdateWeightsFromDiskRequest(_Request):
    """Body of ``POST /update_weights_from_disk``."""

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class UpdateWeightsFromDiskResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class InitWeightsUpdateGroupRequest(_Request):
    """Body of ``POST /init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``): join the group
    the trainer (rank 0) makes at ``master_address:master_port`` as rank ``rank_offset``."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this server's rank (rank 0 is the trainer)")
    world_size: int = Field(ge=2)
    group_name: str = Field(DEFAULT_GROUP, min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_inside(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class _InMemoryUpdate(_Request):
    """The fields SGLang's in-memory updates share."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class UpdateWeightsFromDistributedRequest(_InMemoryUpdate):
    """Body of ``POST /update_weights_from_distributed`` (SGLang's ``UpdateWeightsFromDistributedReqInput``):
    the tensors rank 0 broadcasts, in this order (``load_format: "flattened_bucket"``: as one ``uint8`` bucket)."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(min_length=1)
    shapes: list[list[int]] = Field(min_length=1)
    group_name: str = DEFAULT_GROUP


class UpdateWeightsFromTensorRequest(_InMemoryUpdate):
    """Body of ``POST /update_weights_from_tensor`` (SGLang's ``UpdateWeightsFromTensorReqInput``): tensors a process
    on the same host shares (:mod:`agentrl.inference.tensor_payload`), one base64 entry per tensor-parallel rank."""

    serialized_named_tensors: list[str] = Field(min_length=1)


class BeginWeightUpdateRequest(_Request):
    """Body of ``POST /begin_weight_update`` (SGLang's ``BeginWeightUpdateReqInput``): open a weight-update session;
    SGLang (0.5.23 on) refuses ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` outside one."""

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateRequest(_Request):
    """Body of ``POST /end_weight_update`` (SGLang's ``EndWeightUpdateReqInput``, no fields): close the session."""


class DestroyWeightsUpdateGroupRequest(_Request):
    """Body of ``POST /destroy_weights_update_group``."""

    group_name: str = DEFAULT_GROUP


class WeightUpdateResponse(BaseModel):
    """The answer of SGLang's weight-update-group endpoints (200 on success, else 400)."""

    success: bool
    message: str


class LoadLoRAAdapterRequest(_Request):
    """Body of ``POST /load_lora_adapter``: a PEFT adapter directory, served under ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """Body of ``POST /unload_lora_adapter`` (it answers once no running request uses the adapter)."""

    lora_name: str = Field(min_length=1)


class LoRAUpdateResponse(BaseModel):
    """Answer of both adapter endpoints (200 on success, else 400): the adapters loaded afterwards."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = Field(
        None, description="adapter name -> the path it was loaded from (some SGLang releases: a LoRARef object)")


class MemoryOccupationRequest(_Request):
    """Body of ``POST /release_memory_occupation`` and ``/resume_memory_occupation``."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class ModelInfo(BaseModel):
    """Body of ``GET /get_model_info``."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, Any] | str | None = Field(
        None, description="the server's defaults for omitted sampling parameters (older SGLang: JSON text)")
    weight_version: str | None = None
    has_image_understanding: bool = False
    has_audio_understanding: bool = False


class ChatCompletionRequest(_Request):
    """Body of ``POST /v1/chat/completions`` (the OpenAI fields the engine implements, plus SGLang's extras)."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int = Field(1, ge=1, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    stream: Literal[False] = False
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True
