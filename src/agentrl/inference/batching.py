"""transformers' continuous batching, with SGLang's sampling and logprob semantics plugged in.

The scheduler, paged KV cache, prefix sharing and batching are transformers' ``ContinuousBatchingManager``
(transformers 5.23, ``generation/continuous_batching``). Two small extensions make it behave like SGLang:

* per-request sampling values (temperature, top-k, top-p, min-p, presence and frequency penalties, seed, position)
  travel through the manager's own per-request tensor mechanism
  (``ContinuousBatchingLogitsProcessor.prepare_tensor_args``), so they stay aligned with the logits rows of every
  batch;
* the model runner's sampling step is replaced by :func:`agentrl.inference.sampling.sample`, which applies the
  penalties (over each request's generated tokens, read from its state), draws the token and reports its logprob
  exactly as SGLang does (see that module), reproducibly for a given seed.

Two replace what transformers does per decoding step:

* attention: :mod:`agentrl.inference.paged_attention` (each request attends to its own cached tokens; decoding
  requests together over a padded view) instead of one packed sequence masked block-diagonally;
* on CPU, the Linear layers multiply with oneDNN-packed weights (:mod:`agentrl.inference.packed_linear`),
  repacked when weights are loaded.

transformers' own CUDA graphs (whose decode path needs flash-attn's kernel) and async double-buffering are off;
with ``BatchingConfig.decode_graphs`` the steps in which every request decodes run from static buffers instead,
captured as CUDA graphs on CUDA (:mod:`agentrl.inference.decode_graphs`; sampling stays eager). The rest of the
manager is used as is: requests are added from any thread, results come back through ``register_result_handler``.

New weights are swapped in between two decoding steps while requests keep running (:meth:`ContinuousBatcher.swap`):
each sampled token is recorded with the version of the weights whose logits it was drawn from
(:class:`TokenVersions`), so a request that straddles a swap reports both versions and where the change fell. Its
KV cache stays as computed (the old weights' keys and values for the tokens before the swap, as PipelineRL and
SGLang's in-place pause). Prefix sharing never hands the old weights' blocks to a request after a swap: block hashes
are salted with the number of swaps so far (:func:`_salted_block_hash`).

LoRA adapters (:mod:`agentrl.inference.lora_adapters`) are routed per request: before each forward pass the
runner tells the served adapters which token rows belong to which request's adapter. Prefix sharing then has to
be off (``BatchingConfig.prefix_sharing``): a cached block holds the keys and values of one adapter's model.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from math import ceil

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cache_allocators import cache_allocator
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import FutureRequestState, GenerationOutput, RequestState
from transformers.generation.logits_process import LogitsProcessorList

from agentrl.inference import paged_attention
from agentrl.inference.decode_graphs import DecodeGraphs
from agentrl.inference.decode_kernel import triton_available
from agentrl.inference.lora_adapters import Adapter, ServedAdapters
from agentrl.inference.packed_linear import PackedLinear, pack_linears
from agentrl.inference.sampling import RowParams, penalties, sample
from agentrl.inference.vision_inputs import VisionEncoder, VisionPrompt

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256
"""Prompt positions whose fp32 log-softmax over the vocabulary is made at once (input-token logprobs)."""
ALIGNMENT = 64
"""Bytes a served weight's address is a multiple of (the CPU allocator's alignment)."""


_unsalted_block_hash = cache_allocator.compute_block_hash
_swaps = itertools.count(1)
_block_salt: int | None = None
"""The parent hash of every sequence's first KV block (None until the first weight swap in this process)."""


def _salted_block_hash(parent_hash: int | None, tokens: list[int]) -> int:
    """transformers' block hash, with a first block chained to the current salt: a swap changes the salt, so blocks
    cached under earlier weights are never matched again (a process-wide salt: another batcher's swap only costs
    this one cache misses)."""
    return _unsalted_block_hash(parent_hash if parent_hash is not None else _block_salt, tokens)


cache_allocator.compute_block_hash = _salted_block_hash


class TokenVersions:
    """The weights version each request's tokens were sampled with, as ``[version, tokens]`` runs.

    ``version`` changes only while the generation loop is paused (:meth:`ContinuousBatcher.swap`); :meth:`record`
    runs on the loop thread right after a step sampled its tokens, for the requests :meth:`open` registered."""

    def __init__(self, version: str):
        self.version = version
        self._runs: dict[str, list[list]] = {}

    def open(self, request_id: str) -> None:
        self._runs[request_id] = []

    def record(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            runs = self._runs.get(request_id)
            if runs is None:
                continue
            if runs and runs[-1][0] == self.version:
                runs[-1][1] += 1
            else:
                runs.append([self.version, 1])

    def sampled(self) -> int:
        """Tokens sampled so far by the requests still open."""
        return sum(count for runs in list(self._runs.values()) for _, count in runs)

    def close(self, request_id: str) -> list[list]:
        """Forget the request; returns its runs."""
        return self._runs.pop(request_id, [])


def _first_tokens(runs: list[list], tokens: int) -> list[tuple[str, int]]:
    """``runs`` cut to their first ``tokens`` tokens (a request stopped early may have sampled more than it
    returns)."""
    kept = []
    for version, count in runs:
        if tokens <= 0:
            break
        kept.append((version, min(count, tokens)))
        tokens -= count
    return kept


@dataclass(frozen=True)
class Generation:
    """One request's output: its tokens, their logprobs and ``versions``, the ``(weights version, tokens)`` runs
    that sampled them in order (one run unless weights were swapped while it ran)."""

    generated_tokens: list[int]
    logprobs: list[float]
    versions: list[tuple[str, int]]


class EngineStopped(RuntimeError):
    """The generation loop is not running (stopped, or died with an error)."""


class GenerationAborted(RuntimeError):
    """The request was aborted before it finished (the engine is shutting down)."""


@dataclass(frozen=True)
class RequestSampling:
    """Normalised sampling values of one request (greedy is ``top_k == 1``; ``top_k <= 0`` disables top-k)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class BatchingConfig:
    """Sizing of the continuous-batching cache and batches."""

    max_total_tokens: int = 32768
    max_batch_tokens: int = 2048
    max_running_requests: int = 64
    page_size: int = 32
    prefix_sharing: bool = True
    bf16_matmuls: bool = False  # an fp32 model's layers (not its LM head) multiply in bf16 (``pack_linears``)
    decode_graphs: bool = False  # decode-only steps from static buffers (``DecodeGraphs``), captured on CUDA
    decode_graph_max_requests: int = 64  # the largest batch they serve (larger ones run eagerly)


class _RequestValue(ContinuousBatchingLogitsProcessor):
    """Carries one per-request value into the batch tensors; it does not touch the scores (sampling does)."""

    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, name: str, kind: type, default: float | int):
        self.name, self.kind, self.default = name, kind, default
        # ``position`` is read from the request state, not passed by the caller.
        self.supported_kwargs = {} if name == "position" else {name: kind}

    def _value(self, request: FutureRequestState) -> float | int:
        if self.name == "position":
            return request.state.position_offset  # index of the token being generated (prompt length + generated)
        return request.state.logit_processor_kwargs.get(self.name, self.default)

    def _as_int32(self, values: list) -> torch.Tensor:
        if self.kind is float:
            return torch.tensor(values, dtype=torch.float32).view(torch.int32)
        return torch.tensor(values, dtype=torch.int32)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(self._as_int32([self.default]).expand_as(int32_tensor))

    def prepare_tensor_args(self, requests_with_new_token: list[FutureRequestState]) -> torch.Tensor:
        return self._as_int32([self._value(request) for request in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return scores


# Order matters: rows of ``logits_processor_args`` follow it.
_VALUES = (("temperature", float, 1.0), ("top_k", int, 0), ("top_p", float, 1.0), ("min_p", float, 0.0),
           ("presence_penalty", float, 0.0), ("frequency_penalty", float, 0.0), ("seed", int, 0), ("position", int, 0))


class _RequestValues(ContinuousBatchingLogitsProcessorList):
    """The manager's processor list: only the per-request values, one tensor row each."""

    def __init__(self) -> None:
        super().__init__(LogitsProcessorList([_RequestValue(*spec) for spec in _VALUES]))
        self.tensors_required = len(_VALUES)


def _row_params(args: torch.Tensor, rows: int) -> RowParams:
    """Decode ``logits_processor_args`` ([len(_VALUES), n] int32) for the first ``rows`` logits rows."""
    columns = {name: args[i, :rows].view(torch.float32) if kind is float else args[i, :rows]
               for i, (name, kind, _) in enumerate(_VALUES)}
    return RowParams(**columns)


def _generated_tokens(state: RequestState) -> list[int]:
    """The tokens a request generated so far (one re-queued after offloading carries earlier ones in its prompt)."""
    start = state._true_initial_tokens or len(state.initial_tokens)
    return state.initial_tokens[start:] + state.generated_tokens


class _SGLangSamplingRunner(ModelRunner):
    """transformers' model runner with the sampling step replaced by :func:`sample` and LoRA rows routed."""

    adapters: ServedAdapters | None = None
    versions: TokenVersions | None = None
    graphs: DecodeGraphs | None = None
    vision: VisionEncoder | None = None

    def _forward_process_and_sample(self, model: torch.nn.Module, batch_data: dict, carry_over_ids: torch.Tensor,
                                    prev_output_ids: torch.Tensor, output_ids: torch.Tensor) -> None:
        self.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        if self.adapters is not None and self.adapters.adapters:
            self.adapters.route([(r.state.request_id, r.query_length)
                                 for r in self.inputs_and_outputs.requests_in_batch])
        logits = self._logits(model, batch_data).float()  # [rows, vocab]
        params = _row_params(batch_data["logits_processor_args"], logits.size(0))
        tokens, logprobs = sample(logits, params, self._penalties(params, logits.size(0), logits.size(-1)))
        rows = tokens.size(0)
        output_ids[0, :rows].copy_(tokens)
        output_ids[1, :rows].copy_(logprobs.view(torch.int32))
        if self.versions is not None:
            self.versions.record([r.state.request_id for r in self.inputs_and_outputs.requests_in_batch
                                  if r.has_new_token])

    def _logits(self, model: torch.nn.Module, batch_data: dict) -> torch.Tensor:
        """The step's logits rows [rows, vocab]: from the decode graphs where they serve the step, else eagerly (on
        embeddings, when a request of the step has images)."""
        requests = self.inputs_and_outputs.requests_in_batch
        vision = self.vision
        routed = [(r.state.request_id, r.query_length) for r in requests] if vision is not None else []
        if model.config._attn_implementation != paged_attention.PAGED_ATTENTION:
            logits = vision.step_logits(model, batch_data, routed) if vision is not None else None
            if logits is None:
                logits = model(**batch_data).logits
        else:
            decoding = [bool(r.state.generated_tokens) for r in requests]
            with_images = vision is not None and any(request_id in vision.prompts for request_id, _ in routed)
            graphs = self.graphs
            if (graphs is not None and not with_images and not self.adapters.adapters
                    and graphs.serves(batch_data, decoding)):
                return graphs.forward(batch_data, decoding, self.cache)
            with paged_attention.paged_step(paged_attention.StepLayout.from_batch(batch_data, decoding)):
                logits = vision.step_logits(model, batch_data, routed) if with_images else None
                if logits is None:
                    logits = model(**batch_data).logits
        if "logits_to_keep" not in batch_data:
            logits = logits[:, batch_data["logits_indices"], :]
        return logits[0]

    def _penalties(self, params: RowParams, rows: int, vocab: int) -> torch.Tensor | None:
        """Presence/frequency penalties of the rows; logits rows follow the batch's requests that sample a token."""
        if not bool(((params.presence_penalty != 0) | (params.frequency_penalty != 0)).any()):
            return None
        sampling = [r.state for r in self.inputs_and_outputs.requests_in_batch if r.has_new_token]
        generated = [_generated_tokens(state) for state in sampling[:rows]]
        generated += [[] for _ in range(rows - len(generated))]
        return penalties(generated, params.presence_penalty, params.frequency_penalty, vocab)


class _Manager(ContinuousBatchingManager):
    """transformers' manager with our per-request values and our sampling runner."""

    def __init__(self, model: PreTrainedModel, cb_config: ContinuousBatchingConfig, adapters: ServedAdapters,
                 versions: TokenVersions, graphs: DecodeGraphs | None, vision: VisionEncoder | None):
        super().__init__(model, GenerationConfig(do_sample=False, eos_token_id=-1), cb_config)
        self.logit_processor = _RequestValues()
        self.adapters = adapters
        self.versions = versions
        self.graphs = graphs
        self.vision = vision

    def switch_to_cb_friendly_attn(self, model: PreTrainedModel, auto_switch_to_flash: bool = True) -> None:
        """Serve with :mod:`agentrl.inference.paged_attention` where the model allows (for good: outside a step it
        is ``sdpa``), else as transformers would."""
        if model.config._attn_implementation == "sdpa" and paged_attention.supports(model.config):
            model.set_attn_implementation(paged_attention.PAGED_ATTENTION)
        else:
            super().switch_to_cb_friendly_attn(model, auto_switch_to_flash)

    def _create_batch_processor(self):
        processor = super()._create_batch_processor()
        if not isinstance(processor.model_runner, _SGLangSamplingRunner):
            processor.model_runner = _SGLangSamplingRunner(
                logit_processor=processor.logit_processor, cb_config=processor.cb_config,
                inputs_and_outputs=processor.inputs_and_outputs, cache=processor.cache, do_sample=True,
                return_logprobs=True)
            processor.model_runner.adapters = self.adapters
            processor.model_runner.versions = self.versions
            processor.model_runner.graphs = self.graphs
            processor.model_runner.vision = self.vision
        return processor


@dataclass
class PreparedWeights:
    """New weights made ready to serve (:meth:`ContinuousBatcher.prepare`): each served tensor's replacement (by
    the ``id`` of the tensor it replaces) and the packed copies of the layers."""

    values: dict[int, torch.Tensor] = field(default_factory=dict)
    packed: dict[PackedLinear, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    copied: bool = False  # every value was copied into storage of the engine's own (prepare's ``copy``)


class ContinuousBatcher:
    """Serves generation requests for one model from a background continuous-batching loop.

    ``generate`` may be awaited concurrently from one event loop; the requests are batched together. Weights can
    be swapped with :meth:`load_state_dict`, and LoRA adapters added or removed with :meth:`add_adapter` /
    :meth:`remove_adapter`; each pauses the loop between two steps.
    """

    def __init__(self, model: PreTrainedModel, config: BatchingConfig | None = None, *, version: str = "default",
                 vision: VisionEncoder | None = None):
        self.model = model.eval()
        self.config = config or BatchingConfig()
        pack_linears(self.model, bf16_matmuls=self.config.bf16_matmuls)
        self.adapters = ServedAdapters(self.model)
        self.versions = TokenVersions(version)
        self.vision = vision
        self.graphs = self._decode_graphs()
        self._manager = _Manager(self.model, self._cb_config(), self.adapters, self.versions, self.graphs, vision)
        self.in_flight = 0  # requests handed to the loop and not finished (updated on the event loop thread)
        self._running: dict[str, asyncio.Future[GenerationOutput]] = {}
        self._aborted: str | None = None
        self._prompt_pass = threading.Lock()  # one prompt pass at a time: the adapters' routing is the model's
        self._spare: dict[int, torch.Tensor] = {}  # CPU, after a copied swap: the storage the last version served

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The static decode steps, if configured and the model uses our paged attention (captured on CUDA)."""
        config = self.config
        if not config.decode_graphs or not paged_attention.supports(self.model.config):
            return None
        capture = self.model.device.type == "cuda"
        if capture and not triton_available(self.model.device):
            logger.warning("decode steps run eagerly: CUDA graphs need Triton's paged decode kernel (no triton)")
            return None
        return DecodeGraphs(self.model, max_requests=min(config.decode_graph_max_requests,
                                                         config.max_running_requests),
                            max_pages=ceil(config.max_total_tokens / config.page_size), page_size=config.page_size,
                            capture=capture)

    def _cb_config(self) -> ContinuousBatchingConfig:
        config = self.config
        return ContinuousBatchingConfig(
            page_size=config.page_size, num_blocks=ceil(config.max_total_tokens / config.page_size),
            max_batch_tokens=config.max_batch_tokens, max_requests_per_batch=config.max_running_requests,
            max_blocks_per_request=0, use_cuda_graph=False, use_async_batching=False, return_logprobs=True,
            auto_switch_to_flash=False, allow_block_sharing=config.prefix_sharing)

    def start(self) -> None:
        """Start the generation loop (again, after :meth:`stop`: the KV cache is allocated anew)."""
        self._manager.start()

    def stop(self) -> None:
        """Stop the generation loop and free its KV cache (and the decode graphs captured on it)."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=30)
        if self.graphs is not None:
            self.graphs.reset()

    def is_running(self) -> bool:
        return self._manager.is_running()

    async def generate(self, input_ids: list[int], *, max_new_tokens: int, stop_token_ids: list[int],
                       sampling: RequestSampling, should_stop: Callable[[list[int]], bool] | None = None,
                       adapter: str | None = None, vision: VisionPrompt | None = None) -> Generation:
        """Generate for one prompt; finished when a token of ``stop_token_ids`` is sampled or at the length limit.
        With ``adapter``, the named LoRA adapter (added with :meth:`add_adapter`) applies to the request's tokens.
        With ``vision`` (a prompt with images, from the batcher's :class:`VisionEncoder`), ``input_ids`` are its
        ``cache_ids``.

        With ``should_stop``, the request is streamed internally and stops early (cancelled) as soon as
        ``should_stop(generated_tokens)`` is true; the returned output then holds the tokens up to that point.
        """
        if self._aborted is not None:
            raise EngineStopped(self._aborted)
        if not self._manager.is_running():
            raise EngineStopped("the generation loop is not running")
        done: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        request_id = uuid.uuid4().hex

        def on_output(output: GenerationOutput) -> None:
            if done.done():
                return
            if output.is_finished():
                done.set_result(output)
            elif should_stop is not None and should_stop(output.generated_tokens):
                done.set_result(output)
                self._manager.cancel_request(request_id)

        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)
        self._manager.register_result_handler(request_id, on_output)
        self._running[request_id] = done
        self.versions.open(request_id)
        if adapter is not None:
            self.adapters.assign(request_id, adapter)
        if vision is not None:
            self.vision.prompts[request_id] = vision
        self.in_flight += 1
        try:
            added = self._manager.add_request(
                list(input_ids), request_id=request_id, max_new_tokens=max_new_tokens,
                streaming=should_stop is not None, eos_token_id=list(stop_token_ids),
                temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p),
                min_p=float(sampling.min_p), presence_penalty=float(sampling.presence_penalty),
                frequency_penalty=float(sampling.frequency_penalty), seed=int(seed) & 0x7FFFFFFF)
            if added is None:
                raise EngineStopped("the generation loop refused the request (it is stopping or died)")
            output = await done
        except asyncio.CancelledError:
            self._manager.cancel_request(request_id)
            raise
        finally:
            self.in_flight -= 1
            self._running.pop(request_id, None)
            runs = self.versions.close(request_id)
            self.adapters.release(request_id)
            if vision is not None:
                self.vision.prompts.pop(request_id, None)
            with self._manager.output_router._lock:
                self._manager.output_router.result_handlers.pop(request_id, None)
        if output.error is not None:
            raise RuntimeError(f"generation failed: {output.error}")
        tokens = list(output.generated_tokens)
        return Generation(tokens, list(output.logprobs), _first_tokens(runs, len(tokens)))

    def abort_all(self, message: str) -> int:
        """Abort every running request now (they raise :class:`GenerationAborted`) and refuse new ones; returns how
        many were aborted. Call on the event loop thread that awaits them."""
        self._aborted = message
        aborted = 0
        for request_id, done in list(self._running.items()):
            if not done.done():
                done.set_exception(GenerationAborted(message))
                aborted += 1
            self._manager.cancel_request(request_id)
        return aborted

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """Hold the generation loop between two steps, if it runs (blocking: call from a worker thread)."""
        if not self._manager.is_running():
            yield
            return
        with self._manager.pause():
            yield

    def prompt_logprobs(self, input_ids: list[int], start: int, *, temperature: float = 1.0,
                        adapter: str | None = None, vision: VisionPrompt | None = None) -> list[float]:
        """``log_softmax(logits / temperature)`` of each prompt token after position ``start`` given the tokens
        before it (``len(input_ids) - start - 1`` values), with LoRA adapter ``adapter`` if named (blocking).

        One forward pass of the whole prompt between two generation steps, without the KV cache: the logits are
        kept only from position ``start`` on and turned into logprobs ``PROMPT_LOGPROB_ROWS`` rows at a time.
        Concurrent calls take turns (several may hold the loop's pause, but the LoRA routing is one per model)."""
        if start >= len(input_ids) - 1:
            return []
        request_id = f"prompt-{uuid.uuid4().hex}"
        with self._prompt_pass, self._paused(), torch.no_grad():
            if adapter is not None:
                self.adapters.assign(request_id, adapter)
            try:
                self.adapters.route([(request_id, len(input_ids))])
                ids = torch.tensor([input_ids], device=self.model.device)
                if vision is not None:
                    logits = self.vision.prompt_logits(self.model, vision, len(input_ids) - start)[:-1]
                else:
                    logits = self.model(input_ids=ids, use_cache=False,
                                        logits_to_keep=len(input_ids) - start).logits[0, :-1]
            finally:
                self.adapters.release(request_id)
                self.adapters.route([])
            targets = ids[0, start + 1:]
            picked = [torch.log_softmax(logits[i:i + PROMPT_LOGPROB_ROWS].float() / temperature, dim=-1)
                      .gather(-1, targets[i:i + PROMPT_LOGPROB_ROWS, None]).squeeze(-1)
                      for i in range(0, targets.numel(), PROMPT_LOGPROB_ROWS)]
        return torch.cat(picked).tolist()

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: str) -> None:
        """Serve new weights (every key of the model's state dict; blocking) as ``version``: :meth:`prepare` then
        :meth:`swap`."""
        targets = self.model.state_dict(keep_vars=True)
        if state_dict.keys() != targets.keys():
            missing, unexpected = targets.keys() - state_dict.keys(), state_dict.keys() - targets.keys()
            raise ValueError(f"the new weights do not match the model: missing {sorted(missing)[:3]}, unexpected "
                             f"{sorted(unexpected)[:3]}")
        self.swap(self.prepare(state_dict), version)

    def prepare(self, tensors: dict[str, torch.Tensor], into: PreparedWeights | None = None, *,
                copy: bool = False, pack: bool = True) -> PreparedWeights:
        """Make some of the new weights ready to serve, generation still running (blocking): each state-dict key's
        tensor cast to its parameter's dtype and device (copied only when not contiguous and ``ALIGNMENT``-aligned,
        as the allocator's are: kernels may round differently on other addresses; always with ``copy``, for memory
        the engine does not own, into the storage the previous version served where a copied swap left it), and
        the packed copies of the layers whose weights are all there (not with ``pack=False``: a later call packs
        them, ``tensors`` may be empty). Called once with the whole state dict, or bucket by bucket as they arrive
        (``into``: what earlier calls prepared); :meth:`swap` serves the result."""
        targets = self.model.state_dict(keep_vars=True)
        prepared = into if into is not None else PreparedWeights(copied=copy)
        with torch.no_grad():
            for key, tensor in tensors.items():
                target = targets.get(key)
                if target is None:
                    raise ValueError(f"the new weights do not match the model: unexpected {key}")
                if tensor.shape != target.shape:
                    raise ValueError(f"{key}: shape {list(tensor.shape)} instead of {list(target.shape)}")
                spare = self._spare.pop(id(target), None) if copy else None
                if (spare is not None and spare.shape == target.shape and spare.dtype == target.dtype
                        and spare.is_contiguous() and not spare.data_ptr() % ALIGNMENT):
                    value = spare.copy_(tensor.detach())  # no new pages to fault in
                else:
                    value = tensor.detach().to(dtype=target.dtype, device=target.device, copy=copy)
                    if not value.is_contiguous() or value.data_ptr() % ALIGNMENT:
                        value = value.clone(memory_format=torch.contiguous_format)  # a view into a bucket
                prepared.values[id(target)] = value
            for module in self.model.modules() if pack else ():
                if not isinstance(module, PackedLinear) or module in prepared.packed:
                    continue
                weight = prepared.values.get(id(module.weight))
                bias = None if module.bias is None else prepared.values.get(id(module.bias))
                if weight is not None and (module.bias is None or bias is not None):
                    prepared.packed[module] = module.packing(weight, bias)
        return prepared

    def swap(self, prepared: PreparedWeights, version: str) -> None:
        """Serve the prepared weights (every tensor of the model's state dict must be in them; blocking) as
        ``version``: the loop pauses between two generation steps only to exchange references; running requests
        go on with the new weights (their next tokens are recorded under ``version``), and the prefix cache is
        no longer matched (its blocks hold the old weights' keys and values). While decode graphs are captured the
        values are copied into the parameters' own storage, which the graphs read."""
        global _block_salt
        targets = self.model.state_dict(keep_vars=True)
        missing = [key for key, target in targets.items() if id(target) not in prepared.values]
        if missing:
            raise ValueError(f"the new weights do not match the model: missing {sorted(missing)[:3]}")
        with torch.no_grad(), self._paused(), self.vision.lock if self.vision is not None else nullcontext():
            in_place = self.graphs is not None and self.graphs.in_place_weights
            for target in targets.values():
                if isinstance(target, torch.nn.Parameter) and not in_place:
                    old, target.data = target.data, prepared.values[id(target)]
                    if prepared.copied and old.device.type == "cpu" and old.data_ptr() != target.data_ptr():
                        self._spare[id(target)] = old  # no request uses it after the swap
                else:
                    target.copy_(prepared.values[id(target)])
            for module, (weight, bias) in prepared.packed.items():
                module.packed, module.packed_bias = weight, bias
            self.versions.version = version
            if self.vision is not None:
                self.vision.forget()
            _block_salt = next(_swaps)
            processor = self._manager.batch_processor
            if processor is not None:
                processor.cache.evict_cached_blocks()

    def add_adapter(self, adapter: Adapter) -> None:
        """Serve a LoRA adapter from the next step on (blocking)."""
        with self._paused():
            self.adapters.add(adapter)

    def remove_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter no running request uses (blocking)."""
        with self._paused():
            self.adapters.remove(name)

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (prefix sharing); only call while no request is in flight (blocking)."""
        with self._paused():
            processor = self._manager.batch_processor
            if processor is not None:
                processor.cache.reset()
