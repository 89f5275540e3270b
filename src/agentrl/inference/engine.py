"""The ``agentrl engine`` core: one Hugging Face causal LM served with SGLang's request semantics.

* ``generate`` validates a request (token ids inside the vocabulary, context length), fills the sampling
  parameters it omits from ``preferred_sampling_params`` (like SGLang's ``--preferred-sampling-params``), maps
  them onto the continuous batcher and builds SGLang's response (finish reasons, ``meta_info``). Output logprobs
  are ``log_softmax((logits - penalties) / temperature)`` of the sampled token, as SGLang reports them (see
  :mod:`agentrl.inference.sampling`). With ``logprob_start_len`` the prompt tokens from there on get theirs too
  (``input_token_logprobs``, ``log_softmax(logits / temperature)``, the first one null, as SGLang), from one extra
  forward pass of the prompt with the same weights and adapter, between two generation steps.
* ``update_weights_from_disk`` reads the new checkpoint while generation goes on, then swaps it in between two
  decoding steps (``weight_update_mode="in_place"``, the default): running requests go on with the new weights and
  no request waits; each response's ``weight_version`` is that of its last token and, when its tokens span
  several versions, ``weight_version_spans`` (our extension of SGLang's ``meta_info``) lists
  ``[version, tokens]`` in order. ``"drain"`` (SGLang's behaviour without ``/pause_generation``) closes the
  admission gate instead: running requests finish on the old weights, new ones wait, then the swap.
  :meth:`InferenceEngine.load_published` does the same for an engine joining a run under way.
* ``init_weights_update_group`` / ``update_weights_from_distributed`` / ``destroy_weights_update_group``: SGLang's
  in-memory update inside a ``begin_weight_update`` ... ``end_weight_update`` session, as SGLang 0.5.23 requires
  (a trainer broadcasts the tensors over a process group it shares with the engine; see
  :mod:`agentrl.inference.weight_updates`), swapped in the same way once the whole model has arrived.
* ``load_lora_adapter`` / ``unload_lora_adapter`` (with ``enable_lora``, as SGLang's ``--enable-lora``) serve
  PEFT adapters next to the base weights; a request names one in ``lora_path``. Loading pauses generation for one
  step; unloading waits until no admitted request uses the adapter (new requests naming it are refused at once).
  ``weight_version`` stays as it is, as in SGLang: the adapter's name tells which weights made the tokens.
* ``release_memory`` / ``resume_memory`` (colocated layout) drain the same way, then free the KV cache (and move
  the weights to host memory on an accelerator).
* ``abort_all`` (on shutdown) ends every running generation at once with finish reason ``abort``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from pydantic import BaseModel, Field, field_validator

from agentrl import __version__
from agentrl.failpoints import failpoint
from agentrl.inference.admission import AdmissionGate
from agentrl.inference.batching import (
    BatchingConfig,
    ContinuousBatcher,
    GenerationAborted,
    PreparedWeights,
    RequestSampling,
)
from agentrl.inference.lora_adapters import AdapterError, read_adapter
from agentrl.inference.protocol import (
    BeginWeightUpdateRequest,
    ChatCompletionRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    LoRAUpdateResponse,
    MetaInfo,
    ModelInfo,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    WeightUpdateResponse,
)
from agentrl.inference.sampling import GREEDY_EPS
from agentrl.inference.weight_sync import WeightSyncError
from agentrl.inference.weight_updates import WeightUpdateGroups

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


class BadRequest(ValueError):
    """The request cannot be served as asked (answered with HTTP 400 and this message)."""


class IncompatibleWeights(ValueError):
    """A checkpoint's parameters do not match the served model's names and shapes."""


class EngineConfig(BaseModel):
    """What the engine serves and how (the ``agentrl engine`` flags)."""

    model_name_or_path: str
    served_model_name: str | None = Field(None, description="model name reported to clients (default: dir name)")
    device: str | None = Field(None, description="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    weight_version: str = "0"
    weight_update_mode: Literal["in_place", "drain"] = Field(
        "in_place", description="in_place: new weights are swapped in between two decoding steps and running "
        "requests go on with them (each token keeps its version); drain: running requests finish on the old "
        "weights while new ones wait")
    max_total_tokens: int = Field(32768, gt=0, description="KV cache capacity in tokens, all requests together")
    max_batch_tokens: int = Field(2048, gt=0, description="tokens per forward pass (prefill chunk size)")
    max_running_requests: int = Field(64, gt=0)
    page_size: int = Field(32, ge=4, description="tokens per KV-cache page (prefix sharing granularity)")
    disable_cuda_graph: bool = Field(False, description="on CUDA, run decode steps eagerly instead of replaying "
                                     "them as CUDA graphs captured per batch size")
    cuda_graph_max_bs: int = Field(64, gt=0, description="the largest decode batch run as a CUDA graph (larger "
                                   "ones run eagerly)")
    enable_lora: bool = Field(False, description="serve LoRA adapters loaded at run time (turns prefix sharing off)")
    weight_update_timeout_s: float = Field(
        120.0, gt=0, description="how long joining a weight-update group, and each of its transfers, may take")
    preferred_sampling_params: dict[str, Any] | None = Field(
        None, description="values of the sampling parameters a request omits (SGLang's --preferred-sampling-params)")

    @field_validator("preferred_sampling_params")
    @classmethod
    def _valid_sampling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            InferenceEngine.check_supported(SamplingParams.model_validate(value))
        return value


def resolve_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_num_threads() -> int:
    """The engine's torch CPU threads when none are asked for: ``$OMP_NUM_THREADS`` if set, else one less than the
    CPUs this process may run on (at least 1). A decode step is thousands of small operations, and a thread team
    as large as the machine waits at each one for a member that the HTTP server, the tokenizer or a process beside
    the engine (samplers, tools, a trainer) has preempted. On 2 cores one thread beat two at 1, 4, 16 and 64
    concurrent requests, by 1.15-1.4x (docs/benchmarks.md)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (macOS)
    return max(1, cpus - 1)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The weights dtype. ``auto`` is bf16 on CUDA GPUs that multiply bf16 natively and fp32 elsewhere, on CPU too:
    a bf16 model's bf16 logits put the engine's logprobs too far from the trainer's (see :func:`bf16_matmuls`)."""
    from agentrl.precision import resolve_dtype as resolve

    return torch.float32 if dtype == "auto" and device.type != "cuda" else resolve(dtype, device)


def bf16_matmuls(dtype: str, device: torch.device) -> bool:
    """Whether the fp32 model's layers multiply in bf16 (``packed_linear``): ``auto`` on a CPU with bf16 matrix
    instructions. Measured on 2 AVX-512-BF16 cores, embedded model: 1.26x the fp32 engine's tokens/s at 16
    requests (1.12x at 64), engine-vs-trainer (bf16 layers, fp32 head) logprob gap 0.018 mean nats against 0.015
    for the fp32 engine, where a bf16 model (bf16 logits) gives 0.027-0.034 (``tests/test_trainer_precision.py``)."""
    from agentrl.precision import native_bf16

    return dtype == "auto" and device.type == "cpu" and native_bf16(device)


class _Run(NamedTuple):
    """One admitted generation: output ids and logprobs, finish reason, the weight version of its last token (or
    of its admission), the ``(version, tokens)`` spans of its output, prompt logprobs."""

    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason
    version: str
    spans: list[tuple[str, int]]
    prompt_logprobs: list[float]

    def several_versions(self) -> list[list] | None:
        """The spans as ``[version, tokens]`` when the output spans several versions (SGLang's responses have no
        such key: None otherwise)."""
        return [list(span) for span in self.spans] if len(self.spans) > 1 else None


class InferenceEngine:
    """A loaded model, its tokenizer and the continuous batcher, plus the weight version and admission gate."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = config.model_name_or_path
        self.model_name = config.served_model_name or Path(path.rstrip("/")).name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation="sdpa")
        self.model = model.to(self.device).eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.eos_token_ids = self._eos_token_ids()
        self.batcher = ContinuousBatcher(self.model, BatchingConfig(
            max_total_tokens=config.max_total_tokens, max_batch_tokens=config.max_batch_tokens,
            max_running_requests=config.max_running_requests, page_size=config.page_size,
            prefix_sharing=not config.enable_lora, bf16_matmuls=bf16_matmuls(config.dtype, self.device),
            decode_graphs=self.device.type == "cuda" and not config.disable_cuda_graph,
            decode_graph_max_requests=config.cuda_graph_max_bs), version=config.weight_version)
        graphs = self.batcher.graphs
        self.precision = str(self.dtype).removeprefix("torch.") + (
            ", bf16 matmuls" if self.batcher.config.bf16_matmuls else "") + (
            f", CUDA graphs up to {graphs.sizes[-1]} requests" if graphs is not None and graphs.capture
            else ", eager decode")
        self._adapter_users: dict[str, int] = {}  # loaded adapter -> admitted requests using it
        self._adapter_idle: dict[str, asyncio.Event] = {}  # adapters being unloaded -> set when unused
        self.gate = AdmissionGate()
        self.released = False
        self._exclusive = asyncio.Lock()
        self._session_open = False  # between /begin_weight_update and /end_weight_update
        self.weight_groups = WeightUpdateGroups(self.model, self.device, config.weight_update_timeout_s,
                                                prepare=self.batcher.prepare)

    @property
    def weight_version(self) -> str:
        """The version of the weights served now (the next sampled token's)."""
        return self.batcher.versions.version

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for value in (self.model.generation_config.eos_token_id, self.model.config.eos_token_id,
                      self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return {i for i in ids if 0 <= i < self.vocab_size}

    # ------------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    @property
    def healthy(self) -> bool:
        """The generation loop runs, or was stopped on purpose by a memory release."""
        return self.released or self.batcher.is_running()

    def load(self) -> dict[str, int]:
        """Requests being generated and requests waiting (at the gate during an update or release)."""
        return {"running": self.batcher.in_flight, "queued": self.gate.waiting}

    def loads_report(self) -> dict[str, Any]:
        """SGLang's ``/v1/loads`` body with the counters this engine keeps, one data-parallel rank:
        ``num_running_reqs`` the requests admitted (being generated, their adapter in use), ``num_waiting_reqs``
        those waiting at the gate (during a weight update or memory release)."""
        cuda = self.device.type == "cuda"
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": self.gate.active,
                "num_waiting_reqs": self.gate.waiting, "max_running_requests": self.config.max_running_requests}
        return {"timestamp": datetime.now(UTC).isoformat(), "version": __version__,
                "accelerator": torch.cuda.get_device_name(self.device) if cuda else None,
                "num_accelerators": int(cuda), "loads": [load]}

    def model_info(self) -> ModelInfo:
        return ModelInfo(model_path=self.config.model_name_or_path, tokenizer_path=self.config.model_name_or_path,
                         weight_version=self.weight_version,
                         preferred_sampling_params=self.config.preferred_sampling_params)

    def abort_all(self) -> int:
        """End every running generation now (finish reason ``abort``) and refuse new ones: the engine stops."""
        aborted = self.batcher.abort_all("the engine is shutting down")
        if aborted:
            logger.info("aborted %d running generation(s)", aborted)
        return aborted

    def with_preferred(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the parameters the request did not set taken from ``preferred_sampling_params``."""
        preferred = self.config.preferred_sampling_params
        if not preferred:
            return params
        return SamplingParams.model_validate({**preferred, **params.model_dump(exclude_unset=True)})

    @staticmethod
    def check_supported(params: SamplingParams) -> None:
        """Refuse what the engine does not implement (SGLang's repetition_penalty)."""
        if params.repetition_penalty != 1.0:
            raise BadRequest(f"repetition_penalty {params.repetition_penalty} is not supported by the agentrl "
                             "engine (only 1.0); use presence_penalty / frequency_penalty")

    # ----------------------------------------------------------------------------------------------- generation

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Serve one ``/generate`` request."""
        if request.input_ids is not None:
            input_ids = list(request.input_ids)
        else:
            input_ids = self.tokenizer.encode(request.text)
            if not input_ids:
                raise BadRequest("text encodes to no tokens")
        started = time.perf_counter()
        params = self.with_preferred(request.sampling_params)
        start = None
        if request.return_logprob:  # as SGLang's scheduler: -1 (the default) is the last prompt token
            start = len(input_ids) - 1 if request.logprob_start_len in (None, -1) else request.logprob_start_len
            if start >= len(input_ids):
                raise BadRequest(f"logprob_start_len ({start}) is higher than the number of input tokens "
                                 f"({len(input_ids)}). Request with a lower logprob_start_len.")
        run = await self._run(input_ids, params, request.lora_path, prompt_start=start)
        text = self._text(run.output_ids, run.finish, params)
        meta = MetaInfo(
            id=request.rid or uuid.uuid4().hex, finish_reason=run.finish, prompt_tokens=len(input_ids),
            completion_tokens=len(run.output_ids), cached_tokens=0, weight_version=run.version,
            weight_version_spans=run.several_versions(),
            e2e_latency=time.perf_counter() - started)
        if start is not None:
            def entry(logprob: float | None, token: int) -> tuple[float | None, int, str | None]:
                return logprob, token, self.tokenizer.decode([token]) if request.return_text_in_logprobs else None

            meta.output_token_logprobs = [entry(lp, tok) for lp, tok in zip(run.logprobs, run.output_ids, strict=True)]
            meta.input_token_logprobs = [entry(lp, tok) for lp, tok in
                                         zip([None, *run.prompt_logprobs], input_ids[start:], strict=True)]
        return GenerateResponse(text=text, output_ids=run.output_ids, meta_info=meta)

    async def health_generate(self) -> bool:
        """Generate one token (SGLang's ``/health_generate``); false when that fails or takes too long."""
        if self.released:
            return False
        try:
            await asyncio.wait_for(
                self._run([0], SamplingParams(max_new_tokens=1, temperature=0.0)), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure means unhealthy; say why in the log
            logger.warning("health_generate failed: %s", error)
            return False
        return True

    def _validate(self, input_ids: list[int], params: SamplingParams) -> None:
        self.check_supported(params)
        bad = [i for i in input_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise BadRequest(f"input_ids contains {len(bad)} token id(s) outside the vocabulary [0, "
                             f"{self.vocab_size}): {bad[:5]}")
        for token in params.stop_token_ids or []:
            if not 0 <= token < self.vocab_size:
                raise BadRequest(f"stop_token_ids contains {token}, outside the vocabulary [0, {self.vocab_size})")
        total = len(input_ids) + params.max_new_tokens
        if self.context_length and total > self.context_length:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens."
                f" You requested a total of {total} tokens: {len(input_ids)} tokens from the input and "
                f"{params.max_new_tokens} tokens for the completion.")
        if total > self.config.max_total_tokens:
            raise BadRequest(f"the request needs {total} tokens of KV cache but the engine holds at most "
                             f"{self.config.max_total_tokens} (raise --max_total_tokens)")

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        if params.ignore_eos:  # as in SGLang: ignore_eos also disables stop_token_ids
            return []
        return sorted(self.eos_token_ids | set(params.stop_token_ids or []))

    @staticmethod
    def _sampling(params: SamplingParams) -> RequestSampling:
        penalties = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty}
        if params.temperature < GREEDY_EPS or params.top_k == 1:  # SGLang normalises greedy to top_k = 1
            return RequestSampling(temperature=1.0, top_k=1, seed=params.sampling_seed, **penalties)
        return RequestSampling(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
                               min_p=params.min_p, seed=params.sampling_seed, **penalties)

    async def _run(self, input_ids: list[int], params: SamplingParams, adapter: str | None = None, *,
                   prompt_start: int | None = None) -> _Run:
        """Generate under an admission (and, from ``prompt_start`` on, score the prompt with the same weights)."""
        self._validate(input_ids, params)
        stop_ids = self._stop_token_ids(params)
        matcher = self._stop_string_matcher(params.stop_strings)
        sampling = self._sampling(params)
        async with self.gate.admit():
            version = self.weight_version
            self._use_adapter(adapter)
            prompt: list[float] = []
            try:
                if prompt_start is not None:
                    prompt = await asyncio.to_thread(self.batcher.prompt_logprobs, input_ids, prompt_start,
                                                     temperature=sampling.temperature, adapter=adapter)
                if params.max_new_tokens == 0:
                    return _Run([], [], FinishReason(type="length", length=0), version, [], prompt)
                output = await self.batcher.generate(
                    input_ids, max_new_tokens=params.max_new_tokens, stop_token_ids=stop_ids, sampling=sampling,
                    should_stop=(lambda ids: matcher(ids) is not None) if matcher else None, adapter=adapter)
            except GenerationAborted as error:  # SGLang answers an aborted request, it does not drop it
                return _Run([], [], FinishReason(type="abort", message=str(error)), version, [], prompt)
            finally:
                self._release_adapter(adapter)
        tokens, spans = output.generated_tokens, output.versions
        return _Run(tokens, output.logprobs, self._finish_reason(tokens, params, stop_ids, matcher),
                    spans[-1][0] if spans else version, spans, prompt)

    def _stop_string_matcher(self, stops: list[str]) -> Callable[[list[int]], str | None] | None:
        """A function telling which stop string (if any) the end of the generated tokens contains."""
        stops = [s for s in stops if s]
        if not stops:
            return None
        window = max(len(s) for s in stops) + 1  # a token is at least one character

        def matched(token_ids: list[int]) -> str | None:
            tail = self.tokenizer.decode(token_ids[-window:])
            return next((s for s in stops if s in tail), None)

        return matched

    @staticmethod
    def _finish_reason(tokens: list[int], params: SamplingParams, stop_ids: list[int],
                       matcher: Callable[[list[int]], str | None] | None) -> FinishReason:
        # Same precedence as SGLang's Req.check_finished: length, then stop token, then stop string.
        if len(tokens) >= params.max_new_tokens:
            return FinishReason(type="length", length=params.max_new_tokens)
        if tokens and tokens[-1] in stop_ids:
            return FinishReason(type="stop", matched=tokens[-1])
        matched = matcher(tokens) if matcher and tokens else None
        if matched is not None:
            return FinishReason(type="stop", matched=matched)
        return FinishReason(type="abort", message="generation ended without reaching a stop condition")

    def _text(self, output_ids: list[int], finish: FinishReason, params: SamplingParams) -> str:
        ids = output_ids
        trim = not params.no_stop_trim
        if trim and isinstance(finish.matched, int) and ids:
            ids = ids[:-1]  # SGLang drops the matched stop token from the text
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if trim and isinstance(finish.matched, str):
            position = text.find(finish.matched)
            text = text[:position] if position >= 0 else text
        return text

    # ------------------------------------------------------------------------------------------------- chat

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Serve one OpenAI ``/v1/chat/completions`` request with the model's chat template."""
        try:
            prompt = self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools, add_generation_prompt=True, tokenize=False,
                **(request.chat_template_kwargs or {}))
        except Exception as error:  # template errors are the caller's: bad roles, missing content ...
            raise BadRequest(f"cannot apply the chat template to these messages: {error}") from error
        input_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_new = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_new is None:
            limit = min(self.context_length or self.config.max_total_tokens, self.config.max_total_tokens)
            max_new = max(limit - len(input_ids), 0)
        given = {"max_new_tokens": max_new, "temperature": request.temperature, "top_p": request.top_p,
                 "top_k": request.top_k, "min_p": request.min_p, "presence_penalty": request.presence_penalty,
                 "frequency_penalty": request.frequency_penalty, "stop": request.stop,
                 "stop_token_ids": request.stop_token_ids, "sampling_seed": request.seed,
                 "skip_special_tokens": request.skip_special_tokens}
        params = self.with_preferred(SamplingParams(**{k: v for k, v in given.items() if v is not None}))
        run = await self._run(input_ids, params)
        output_ids, logprobs, finish, version = run.output_ids, run.logprobs, run.finish, run.version
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": self._text(output_ids, finish, params)},
            "finish_reason": "length" if finish.type == "length" else "stop",
            "logprobs": None,
        }
        if request.logprobs:
            pieces = [self.tokenizer.decode([tok]) for tok in output_ids]
            choice["logprobs"] = {"content": [
                {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                for piece, lp in zip(pieces, logprobs, strict=True)]}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(output_ids),
                      "total_tokens": len(input_ids) + len(output_ids)},
            "metadata": {"weight_version": version} | (
                {"weight_version_spans": spans} if (spans := run.several_versions()) else {}),
        }

    # ------------------------------------------------------------------------------------------ weight updates

    async def update_weights_from_disk(self, request: UpdateWeightsFromDiskRequest) -> UpdateWeightsFromDiskResponse:
        """Load a checkpoint directory into the served model without dropping any request."""
        if request.abort_all_requests:
            return UpdateWeightsFromDiskResponse(
                success=False, message="abort_all_requests is not supported: running requests always finish")
        if request.load_format not in (None, "auto"):
            return UpdateWeightsFromDiskResponse(
                success=False, message=f"load_format {request.load_format!r} is not supported (use auto)")
        try:
            new_version = self._next_version(request.weight_version)
        except WeightSyncError as error:
            return UpdateWeightsFromDiskResponse(success=False, message=str(error))
        started = time.perf_counter()
        try:
            state_dict = await asyncio.to_thread(self._read_checkpoint, request.model_path)
        except IncompatibleWeights as error:
            return UpdateWeightsFromDiskResponse(
                success=False, message=f"weights in {request.model_path} do not fit the model: {error}")
        except Exception as error:  # noqa: BLE001 - reported to the caller, who asked for this path
            return UpdateWeightsFromDiskResponse(
                success=False, message=f"failed to read weights from {request.model_path}: {error}")
        paused = await self._swap(state_dict, new_version)
        message = (f"loaded weights from {request.model_path} as weight_version {new_version} in "
                   f"{time.perf_counter() - started:.2f}s")
        logger.info(message)
        return UpdateWeightsFromDiskResponse(success=True, message=message, num_paused_requests=paused)

    async def _swap(self, weights: dict[str, torch.Tensor] | PreparedWeights, new_version: str) -> int:
        """Serve ``weights`` (a state dict, or weights already prepared) as ``new_version`` in one step, between
        two decoding steps; returns how many requests waited (none in place; under ``drain``, those that arrived
        while running requests finished on the old weights)."""
        if isinstance(weights, dict):
            weights = await asyncio.to_thread(self.batcher.prepare, weights)
        async with self._exclusive:
            if self.config.weight_update_mode == "in_place":
                await asyncio.to_thread(self._swap_now, weights, new_version)
                return 0
            held_before = self.gate.held
            async with self.gate.closed():
                await asyncio.to_thread(self._swap_now, weights, new_version)
                await asyncio.to_thread(self.batcher.reset_prefix_cache)
            return self.gate.held - held_before

    def _swap_now(self, weights: PreparedWeights, new_version: str) -> None:
        """Swap (blocking); the ``engine.update_weights.swap`` failpoint keeps the old weights under the new name."""
        if failpoint("engine.update_weights.swap"):
            weights = self.batcher.prepare(dict(self.model.state_dict()))
        self.batcher.swap(weights, new_version)

    def _next_version(self, requested: str | None) -> str:
        """The version a swap serves: the one requested, else the current one plus one (WeightSyncError if the
        current one is not a number)."""
        if requested is not None:
            return requested
        if not self.weight_version.isdigit():
            raise WeightSyncError(f"the current weight_version {self.weight_version!r} is not a number: give "
                                  "weight_version")
        return str(int(self.weight_version) + 1)

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> WeightUpdateResponse:
        """Join a weight-update group as rank ``rank_offset`` (blocks until the trainer and every server joined)."""
        try:
            await self.weight_groups.join(request.master_address, request.master_port, request.rank_offset,
                                          request.world_size, request.group_name, request.backend)
        except Exception as error:  # noqa: BLE001 - SGLang answers every failure with success false
            return WeightUpdateResponse(success=False, message=f"Failed to initialize custom process group: {error}.")
        logger.info("joined weight update group %s as rank %d of %d (%s, %s:%d)", request.group_name,
                    request.rank_offset, request.world_size, request.backend, request.master_address,
                    request.master_port)
        return WeightUpdateResponse(success=True, message="Succeeded to initialize custom process group.")

    async def begin_weight_update(self, request: BeginWeightUpdateRequest) -> WeightUpdateResponse:
        """Open a weight-update session (SGLang's answers: one session at a time)."""
        if request.selector == "draft":
            return WeightUpdateResponse(success=False, message="selector 'draft': this engine has no draft model")
        if self._session_open:
            return WeightUpdateResponse(success=False, message=(
                "a weight-update session is already open; call end_weight_update() first"))
        self._session_open = True
        return WeightUpdateResponse(success=True, message="Success")

    async def end_weight_update(self, request: EndWeightUpdateRequest) -> WeightUpdateResponse:
        """Close the weight-update session."""
        if not self._session_open:
            return WeightUpdateResponse(success=False, message=(
                "no weight-update session is open; call begin_weight_update() first"))
        self._session_open = False
        return WeightUpdateResponse(success=True, message="Success")

    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest) -> WeightUpdateResponse:
        try:
            self.weight_groups.leave(request.group_name)
        except Exception as error:  # noqa: BLE001
            return WeightUpdateResponse(success=False, message=str(error))
        return WeightUpdateResponse(success=True, message="Succeeded to destroy custom process group.")

    async def update_weights_from_distributed(self, request: UpdateWeightsFromDistributedRequest
                                              ) -> WeightUpdateResponse:
        """Receive tensors broadcast by the group's rank 0; swap them in once the whole model has arrived
        (:mod:`agentrl.inference.weight_updates`: all or nothing)."""
        started = time.perf_counter()
        try:
            new_version = self._in_memory_version(request, "update_weights_from_distributed")
            complete = await self.weight_groups.receive(request.group_name, request.names, request.dtypes,
                                                        request.shapes, request.load_format)
        except WeightSyncError as error:
            return WeightUpdateResponse(success=False, message=str(error))
        return await self._serve_when_complete(complete, len(request.names), request.group_name, new_version,
                                               started)

    async def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> WeightUpdateResponse:
        """Take tensors a process on this host shares (copied off its memory before answering); swap them in once
        the whole model has arrived, as :meth:`update_weights_from_distributed`."""
        started = time.perf_counter()
        try:
            new_version = self._in_memory_version(request, "update_weights_from_tensor")
            if len(request.serialized_named_tensors) != 1:
                raise WeightSyncError(f"serialized_named_tensors has {len(request.serialized_named_tensors)} "
                                      "entries: one per tensor-parallel rank, and this engine is one rank")
            received, complete = await self.weight_groups.receive_tensors(request.serialized_named_tensors[0],
                                                                          request.load_format)
        except WeightSyncError as error:
            return WeightUpdateResponse(success=False, message=str(error))
        return await self._serve_when_complete(complete, received, None, new_version, started)

    def _in_memory_version(self, request: UpdateWeightsFromDistributedRequest | UpdateWeightsFromTensorRequest,
                           endpoint: str) -> str:
        """The version an in-memory update serves, once the request is one this engine takes (SGLang's session
        included); :class:`WeightSyncError` otherwise."""
        if request.abort_all_requests:
            raise WeightSyncError("abort_all_requests is not supported: running requests are never aborted")
        if request.selector == "draft":
            raise WeightSyncError("selector 'draft': this engine has no draft model")
        if not self._session_open:
            raise WeightSyncError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")
        return self._next_version(request.weight_version)

    async def _serve_when_complete(self, complete: PreparedWeights | None, received: int, group_name: str | None,
                                   new_version: str, started: float) -> WeightUpdateResponse:
        """Swap ``complete`` in (the whole model arrived) or say how much of it is staged (``group_name`` None:
        the tensor updates')."""
        parameters = len(self.weight_groups.names)
        if complete is None:
            return WeightUpdateResponse(success=True, message=(
                f"received {received} tensor(s); {self.weight_groups.staged(group_name)} of {parameters} parameters "
                "staged: the new weights are served once all arrived"))
        paused = await self._swap(complete, new_version)
        source = "tensors" if group_name is None else f"group {group_name}"
        message = (f"Succeeded to update model weights: {parameters} parameters from {source} as weight_version "
                   f"{new_version} in {time.perf_counter() - started:.2f}s ({paused} request(s) waited)")
        logger.info(message)
        return WeightUpdateResponse(success=True, message=message)

    async def load_published(self, path: str, version: int) -> None:
        """Serve the run's published weights at ``path`` as ``version`` (an engine joining a run under way);
        raises :class:`RuntimeError` with the reason when they cannot be loaded."""
        result = await self.update_weights_from_disk(
            UpdateWeightsFromDiskRequest(model_path=path, weight_version=str(version)))
        if not result.success:
            raise RuntimeError(f"cannot serve the run's published policy version {version}: {result.message}")

    def _read_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """Load a checkpoint's state dict on the host and check it matches the served model key for key."""
        from transformers import AutoModelForCausalLM

        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path} is not a directory")
        state_dict = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).state_dict()
        served = {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}
        loaded = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
        problems = [f"missing {name}" for name in served.keys() - loaded.keys()]
        problems += [f"unexpected {name}" for name in loaded.keys() - served.keys()]
        problems += [f"{name}: shape {loaded[name]} instead of {shape}" for name, shape in served.items()
                     if name in loaded and loaded[name] != shape]
        if problems:
            raise IncompatibleWeights(f"{len(problems)} mismatch(es), e.g. {'; '.join(sorted(problems)[:3])}")
        return state_dict

    async def flush_cache(self) -> bool:
        """Forget the prefix cache; like SGLang, refuse (false) while requests are running or waiting."""
        if self.gate.active or self.gate.waiting:
            return False
        async with self._exclusive, self.gate.closed():
            await asyncio.to_thread(self.batcher.reset_prefix_cache)
        return True

    # ------------------------------------------------------------------------------------------ LoRA adapters

    def _use_adapter(self, name: str | None) -> None:
        """Count an admitted request on adapter ``name``; SGLang's errors for a disabled or unknown adapter."""
        if name is None:
            return
        if not self.config.enable_lora:
            raise BadRequest(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
                             "engine with --enable_lora and load adapters with the /load_lora_adapter endpoint.")
        if name not in self._adapter_users or name in self._adapter_idle:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {sorted(self.loaded_adapters())}.")
        self._adapter_users[name] += 1

    def _release_adapter(self, name: str | None) -> None:
        if name is None:
            return
        self._adapter_users[name] -= 1
        if not self._adapter_users[name] and name in self._adapter_idle:
            self._adapter_idle[name].set()

    def loaded_adapters(self) -> dict[str, str]:
        """Adapters that requests may name: name -> the path it was loaded from."""
        return {name: adapter.path for name, adapter in self.batcher.adapters.adapters.items()
                if name not in self._adapter_idle}

    def _lora_result(self, error: str | None = None) -> LoRAUpdateResponse:
        return LoRAUpdateResponse(success=error is None, error_message=error, loaded_adapters=self.loaded_adapters())

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> LoRAUpdateResponse:
        """Serve the PEFT adapter at ``lora_path`` under ``lora_name`` (running requests are not disturbed)."""
        if not self.config.enable_lora:
            return self._lora_result("LoRA is not enabled. Please launch the engine with --enable_lora.")
        name = request.lora_name
        if name in self._adapter_users:
            return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
        started = time.perf_counter()
        try:
            adapter = await asyncio.to_thread(read_adapter, name, request.lora_path, self.model)
            if failpoint("engine.load_lora_adapter.apply"):
                adapter = dataclasses.replace(adapter, layers={})
        except AdapterError as error:
            return self._lora_result(f"Failed to load LoRA adapter {name}: {error}")
        except Exception as error:  # noqa: BLE001 - reported to the caller, who asked for this path
            return self._lora_result(f"Failed to load LoRA adapter {name} from {request.lora_path}: {error}")
        async with self._exclusive:
            if name in self._adapter_users:  # loaded by a concurrent request meanwhile
                return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
            await asyncio.to_thread(self.batcher.add_adapter, adapter)
            self._adapter_users[name] = 0
        logger.info("loaded LoRA adapter %s from %s (%d layers) in %.2fs", name, request.lora_path,
                    len(adapter.layers), time.perf_counter() - started)
        return self._lora_result()

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> LoRAUpdateResponse:
        """Stop serving adapter ``lora_name`` once the requests using it have finished; new ones are refused."""
        if not self.config.enable_lora:
            return self._lora_result("LoRA is not enabled. Please launch the engine with --enable_lora.")
        name = request.lora_name
        if name not in self._adapter_users or name in self._adapter_idle:
            return self._lora_result(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                     f"{sorted(self.loaded_adapters())}")
        idle = self._adapter_idle[name] = asyncio.Event()
        if not self._adapter_users[name]:
            idle.set()
        try:
            await idle.wait()
        except asyncio.CancelledError:  # the caller gave up: the adapter stays loaded and usable
            del self._adapter_idle[name]
            raise
        async with self._exclusive:
            await asyncio.to_thread(self.batcher.remove_adapter, name)
            del self._adapter_users[name], self._adapter_idle[name]
        logger.info("unloaded LoRA adapter %s", name)
        return self._lora_result()

    # ------------------------------------------------------------------------------------- memory occupation

    async def release_memory(self) -> None:
        """Drain, then free the KV cache (and move weights to host memory on an accelerator)."""
        async with self._exclusive:
            if self.released:
                return
            await self.gate.close()  # stays closed until resume: requests wait
            await asyncio.to_thread(self.batcher.stop)
            if self.device.type != "cpu":
                await asyncio.to_thread(self._move_weights, torch.device("cpu"))
            self.released = True

    async def resume_memory(self) -> None:
        """Undo :meth:`release_memory` and admit requests again."""
        async with self._exclusive:
            if not self.released:
                return
            if self.device.type != "cpu":
                await asyncio.to_thread(self._move_weights, self.device)
            await asyncio.to_thread(self.batcher.start)
            self.released = False
            await self.gate.open()

    def _move_weights(self, device: torch.device) -> None:
        self.model.to(device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()
