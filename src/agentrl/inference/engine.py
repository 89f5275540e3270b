"""The ``agentrl engine`` core: one Hugging Face causal LM served with SGLang's request semantics.

* ``generate`` validates a request (token ids inside the vocabulary, context length), fills the sampling
  parameters it omits from ``preferred_sampling_params`` (like SGLang's ``--preferred-sampling-params``), maps
  them onto the continuous batcher and builds SGLang's response (finish reasons, ``meta_info``). Output logprobs
  are ``log_softmax((logits - penalties) / temperature)`` of the sampled token, as SGLang reports them (see
  :mod:`agentrl.inference.sampling`). With ``logprob_start_len`` the prompt tokens from there on get theirs too
  (``input_token_logprobs``, ``log_softmax(logits / temperature)``, the first one null, as SGLang), from one extra
  forward pass of the prompt with the same weights and adapter, between two generation steps.
* ``weights`` (:mod:`agentrl.inference.weight_endpoints`): SGLang's weight-update endpoints, from disk, a
  weight-update group or shared memory, swapped in between two decoding steps; each response's ``weight_version``
  is that of its last token and, when its tokens span several versions, ``weight_version_spans`` (our extension
  of SGLang's ``meta_info``) lists ``[version, tokens]`` in order.
* ``adapters`` (:mod:`agentrl.inference.adapter_endpoints`): SGLang's LoRA adapter endpoints (``enable_lora``).
* ``release_memory`` / ``resume_memory`` (colocated layout) drain the same way, then free the KV cache (and move
  the weights to host memory on an accelerator).
* ``abort_all`` (on shutdown) ends every running generation at once with finish reason ``abort``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

from agentrl import __version__
from agentrl.inference.adapter_endpoints import AdapterEndpoints
from agentrl.inference.admission import AdmissionGate
from agentrl.inference.batching import (
    BatchingConfig,
    ContinuousBatcher,
    GenerationAborted,
)
from agentrl.inference.engine_config import EngineConfig
from agentrl.inference.packed_linear import ROW_BLOCK, row_layouts
from agentrl.inference.protocol import (
    BadRequest,
    ChatCompletionRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    ModelInfo,
    SamplingParams,
)
from agentrl.inference.request_rules import (
    finish_reason,
    output_text,
    request_sampling,
    stop_string_matcher,
    stop_token_ids,
    validate,
)
from agentrl.inference.vision_inputs import VisionEncoder, VisionPrompt
from agentrl.inference.weight_endpoints import WeightEndpoints
from agentrl.vision.images import ImageError, LoadedImage, decode_image_string
from agentrl.vision.processor import VisionInputError, VisionProcessor, model_class, refuse_images

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


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


def row_layout_note(model: torch.nn.Module) -> str:
    """What the start-up line says of the packed layers' row layouts (nothing when every layer takes its rows as they
    come): the cost of answers that do not depend on the prefix cache on this CPU, or that they do."""
    layouts = row_layouts(model)
    if any(not layout.exact for layout in layouts):
        return ", NOT cache-invariant (this CPU's kernels give a row other bits beside other rows)"
    if any(layout.block_rows for layout in layouts):
        return f", rows in blocks of {ROW_BLOCK} (this CPU's kernels depend on the row count)"
    return ""


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
    """A loaded model, its tokenizer and the continuous batcher, plus the weight version and admission gate; for a
    vision-language model (the Qwen-VL family) also its image processor and vision encoder."""

    def __init__(self, config: EngineConfig):
        from agentrl.inference.policy_tokenizer import policy_tokenizer

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = config.model_name_or_path
        self.model_name = config.served_model_name or Path(path.rstrip("/")).name
        self.tokenizer = policy_tokenizer(path)
        processor = VisionProcessor.of(path)
        model = model_class(None if processor is None else processor.model_type).from_pretrained(
            path, dtype=self.dtype, attn_implementation="sdpa")
        self.model = model.to(self.device).eval()
        self.vision = None if processor is None else VisionEncoder(self.model, processor)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        text_config = self.model.config.get_text_config()
        self.context_length = int(getattr(text_config, "max_position_embeddings", 0) or 0) or None
        self.eos_token_ids = self._eos_token_ids()
        self.batcher = ContinuousBatcher(self.model, BatchingConfig(
            max_total_tokens=config.max_total_tokens, max_batch_tokens=config.max_batch_tokens,
            max_running_requests=config.max_running_requests, page_size=config.page_size,
            prefix_sharing=not config.enable_lora, bf16_matmuls=bf16_matmuls(config.dtype, self.device),
            decode_graphs=self.device.type == "cuda" and not config.disable_cuda_graph,
            decode_graph_max_requests=config.cuda_graph_max_bs), version=config.weight_version, vision=self.vision)
        graphs = self.batcher.graphs
        self.precision = str(self.dtype).removeprefix("torch.") + (
            ", bf16 matmuls" if self.batcher.config.bf16_matmuls else "") + row_layout_note(self.model) + (
            f", CUDA graphs up to {graphs.sizes[-1]} requests" if graphs is not None and graphs.capture
            else ", eager decode")
        self.gate = AdmissionGate()
        self.released = False
        self._exclusive = asyncio.Lock()  # swaps, adapter changes and memory releases take turns
        self.weights = WeightEndpoints(self.batcher, self.dtype, config.weight_update_mode, self.gate,
                                       self._exclusive, config.weight_update_timeout_s)
        self.adapters = AdapterEndpoints(self.batcher, config.enable_lora, self._exclusive)

    @property
    def weight_version(self) -> str:
        """The version of the weights served now (the next sampled token's)."""
        return self.batcher.versions.version

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for value in (self.model.generation_config.eos_token_id, self.model.config.get_text_config().eos_token_id,
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
        try:
            images = [decode_image_string(item, f"image_data[{i}]") for i, item in enumerate(request.images())]
        except ImageError as error:
            raise BadRequest(str(error)) from None
        vision = await self._vision_prompt(input_ids, images)
        if vision is not None:
            input_ids = vision.ids
        params = self.with_preferred(request.sampling_params)
        start = None
        if request.return_logprob:  # as SGLang's scheduler: -1 (the default) is the last prompt token
            start = len(input_ids) - 1 if request.logprob_start_len in (None, -1) else request.logprob_start_len
            if start >= len(input_ids):
                raise BadRequest(f"logprob_start_len ({start}) is higher than the number of input tokens "
                                 f"({len(input_ids)}). Request with a lower logprob_start_len.")
        run = await self._run(input_ids, params, request.lora_path, prompt_start=start, vision=vision)
        text = output_text(self.tokenizer, run.output_ids, run.finish, params)
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

    async def _vision_prompt(self, input_ids: list[int], images: list[LoadedImage]) -> VisionPrompt | None:
        """The prompt's vision prompt (its images encoded, its image tokens expanded); None without images. Image
        placeholders without images, images without placeholders or for a text-only model are a bad request."""
        try:
            if self.vision is None:
                refuse_images(self.model_name, len(images))
                return None
            if not images:
                self.vision.processor.expand(input_ids, [])  # no image placeholders without images
                return None
            return await asyncio.to_thread(self.vision.prompt, input_ids, images)
        except (ImageError, VisionInputError) as error:
            raise BadRequest(str(error)) from None

    async def _run(self, input_ids: list[int], params: SamplingParams, adapter: str | None = None, *,
                   prompt_start: int | None = None, vision: VisionPrompt | None = None) -> _Run:
        """Generate under an admission (and, from ``prompt_start`` on, score the prompt with the same weights);
        with ``vision``, ``input_ids`` are its real ids and the batcher gets its ``cache_ids``."""
        validate(input_ids, params, self.vocab_size, self.context_length, self.config.max_total_tokens)
        stop_ids = stop_token_ids(params, self.eos_token_ids)
        matcher = stop_string_matcher(self.tokenizer, params.stop_strings)
        sampling = request_sampling(params)
        async with self.gate.admit():
            version = self.weight_version
            self.adapters.use(adapter)
            prompt: list[float] = []
            try:
                if prompt_start is not None:
                    prompt = await asyncio.to_thread(self.batcher.prompt_logprobs, input_ids, prompt_start,
                                                     temperature=sampling.temperature, adapter=adapter,
                                                     vision=vision)
                if params.max_new_tokens == 0:
                    return _Run([], [], FinishReason(type="length", length=0), version, [], prompt)
                output = await self.batcher.generate(
                    vision.cache_ids if vision is not None else input_ids, max_new_tokens=params.max_new_tokens,
                    stop_token_ids=stop_ids, sampling=sampling,
                    should_stop=(lambda ids: matcher(ids) is not None) if matcher else None, adapter=adapter,
                    vision=vision)
            except GenerationAborted as error:  # SGLang answers an aborted request, it does not drop it
                return _Run([], [], FinishReason(type="abort", message=str(error)), version, [], prompt)
            finally:
                self.adapters.release(adapter)
        tokens, spans = output.generated_tokens, output.versions
        return _Run(tokens, output.logprobs, finish_reason(tokens, params, stop_ids, matcher),
                    spans[-1][0] if spans else version, spans, prompt)

    # ------------------------------------------------------------------------------------------------- chat

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Serve one OpenAI ``/v1/chat/completions`` request with the model's chat template (``image_url`` parts of
        a message's content are its images, rendered by the template as image placeholders)."""
        messages, images = chat_images(request.messages)
        if self.vision is None:  # before the template, which may not take a list of parts at all
            try:
                refuse_images(self.model_name, len(images))
            except VisionInputError as error:
                raise BadRequest(str(error)) from None
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, tools=request.tools, add_generation_prompt=True, tokenize=False,
                **(request.chat_template_kwargs or {}))
        except Exception as error:  # template errors are the caller's: bad roles, missing content ...
            raise BadRequest(f"cannot apply the chat template to these messages: {error}") from error
        input_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        vision = await self._vision_prompt(input_ids, images)
        if vision is not None:
            input_ids = vision.ids
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
        run = await self._run(input_ids, params, vision=vision)
        output_ids, logprobs, finish, version = run.output_ids, run.logprobs, run.finish, run.version
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": output_text(self.tokenizer, output_ids, finish, params)},
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

    async def flush_cache(self) -> bool:
        """Forget the prefix cache; like SGLang, refuse (false) while requests are running or waiting."""
        if self.gate.active or self.gate.waiting:
            return False
        async with self._exclusive, self.gate.closed():
            await asyncio.to_thread(self.batcher.reset_prefix_cache)
        return True

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


def chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
    """The messages with each OpenAI ``image_url`` content part made ``{"type": "image"}`` (what the Qwen-VL chat
    templates render as an image placeholder), and the images in order. A part's URL must be a ``data:`` URI."""
    images: list[LoadedImage] = []
    out = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                where = f"messages[{m}].content[{p}].image_url"
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise BadRequest(f"{where}: expected {{'url': 'data:image/...;base64,...'}}")
                try:
                    images.append(decode_image_string(url, where))
                except ImageError as error:
                    raise BadRequest(str(error)) from None
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images
