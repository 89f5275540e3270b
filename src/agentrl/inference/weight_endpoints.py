"""SGLang's weight-update endpoints of one engine: new weights from a checkpoint directory, from a weight-update
group (``init_weights_update_group``, ``update_weights_from_distributed``, ``destroy_weights_update_group``) or
from memory shared on this host (``update_weights_from_tensor``), the in-memory ones inside a
``begin_weight_update`` ... ``end_weight_update`` session as SGLang 0.5.23 requires.

Whatever their source, new weights are prepared while generation goes on and swapped in at once between two
decoding steps once the whole model is there: with ``weight_update_mode="in_place"`` (the default) running requests
go on with them and no request waits (each token keeps the version that sampled it); with ``"drain"`` (SGLang
without ``/pause_generation``) the admission gate closes while running requests finish on the old weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from agentrl.failpoints import failpoint
from agentrl.inference.admission import AdmissionGate
from agentrl.inference.batching import ContinuousBatcher, PreparedWeights
from agentrl.inference.protocol import (
    BeginWeightUpdateRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    WeightUpdateResponse,
)
from agentrl.inference.weight_sync import WeightSyncError
from agentrl.inference.weight_updates import WeightUpdateGroups

logger = logging.getLogger(__name__)


class IncompatibleWeights(ValueError):
    """A checkpoint's parameters do not match the served model's names and shapes."""


class WeightEndpoints:
    """The weight-update endpoints of an engine serving ``batcher``'s model in ``dtype``; ``exclusive`` is the lock
    the engine's swaps, adapter changes and memory releases take turns on, ``gate`` its admission gate."""

    def __init__(self, batcher: ContinuousBatcher, dtype: torch.dtype, mode: str, gate: AdmissionGate,
                 exclusive: asyncio.Lock, timeout_s: float):
        self.batcher, self.model, self.dtype, self.mode = batcher, batcher.model, dtype, mode
        self.gate, self.exclusive = gate, exclusive
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.groups = WeightUpdateGroups(self.model, self.model.device, timeout_s, prepare=batcher.prepare)

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
        async with self.exclusive:
            if self.mode == "in_place":
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
        if not self.batcher.versions.version.isdigit():
            raise WeightSyncError(f"the current weight_version {self.batcher.versions.version!r} is not a number: give "
                                  "weight_version")
        return str(int(self.batcher.versions.version) + 1)

    async def init_weights_update_group(self, request: InitWeightsUpdateGroupRequest) -> WeightUpdateResponse:
        """Join a weight-update group as rank ``rank_offset`` (blocks until the trainer and every server joined)."""
        try:
            await self.groups.join(request.master_address, request.master_port, request.rank_offset,
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
        if self.session_open:
            return WeightUpdateResponse(success=False, message=(
                "a weight-update session is already open; call end_weight_update() first"))
        self.session_open = True
        return WeightUpdateResponse(success=True, message="Success")

    async def end_weight_update(self, request: EndWeightUpdateRequest) -> WeightUpdateResponse:
        """Close the weight-update session."""
        if not self.session_open:
            return WeightUpdateResponse(success=False, message=(
                "no weight-update session is open; call begin_weight_update() first"))
        self.session_open = False
        return WeightUpdateResponse(success=True, message="Success")

    async def destroy_weights_update_group(self, request: DestroyWeightsUpdateGroupRequest) -> WeightUpdateResponse:
        try:
            self.groups.leave(request.group_name)
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
            complete = await self.groups.receive(request.group_name, request.names, request.dtypes,
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
            received, complete = await self.groups.receive_tensors(request.serialized_named_tensors[0],
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
        if not self.session_open:
            raise WeightSyncError(f"{endpoint} must run between begin_weight_update() and end_weight_update()")
        return self._next_version(request.weight_version)

    async def _serve_when_complete(self, complete: PreparedWeights | None, received: int, group_name: str | None,
                                   new_version: str, started: float) -> WeightUpdateResponse:
        """Swap ``complete`` in (the whole model arrived) or say how much of it is staged (``group_name`` None:
        the tensor updates')."""
        parameters = len(self.groups.names)
        if complete is None:
            return WeightUpdateResponse(success=True, message=(
                f"received {received} tensor(s); {self.groups.staged(group_name)} of {parameters} parameters "
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
        from agentrl.vision.processor import model_class, model_type

        if not Path(path).is_dir():
            raise FileNotFoundError(f"{path} is not a directory")
        state_dict = model_class(model_type(path)).from_pretrained(path, dtype=self.dtype).state_dict()
        served = {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}
        loaded = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
        problems = [f"missing {name}" for name in served.keys() - loaded.keys()]
        problems += [f"unexpected {name}" for name in loaded.keys() - served.keys()]
        problems += [f"{name}: shape {loaded[name]} instead of {shape}" for name, shape in served.items()
                     if name in loaded and loaded[name] != shape]
        if problems:
            raise IncompatibleWeights(f"{len(problems)} mismatch(es), e.g. {'; '.join(sorted(problems)[:3])}")
        return state_dict
