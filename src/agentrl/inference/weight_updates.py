"""The engine's side of SGLang's in-memory weight updates: its groups and the staging of a new version.

``/init_weights_update_group`` joins a group (:func:`agentrl.inference.weight_sync.init_group`, as rank
``rank_offset``: one engine is one rank) and ``/destroy_weights_update_group`` leaves it. Each
``/update_weights_from_distributed`` receives its tensors into new tensors, never into the served weights, and
checks them against the served model (a name it does not have, or another shape, is a 400 naming the tensor: the
update is dropped, the served weights stay). **All or nothing**: received tensors are staged until every parameter
of the model has arrived since the last swap (one call with the whole model, or one call per bucket); only then is
the staged set handed back to be swapped in in one step, and only then does ``weight_version`` change. Each
bucket is made ready to serve (cast, packed: ``ContinuousBatcher.prepare``) in the background once its call has
answered, while the next bucket travels, so the last bucket leaves little to do before the swap. SGLang
instead loads each call's tensors at once, so between two calls it serves a mix; with ours a trainer that sends
part of the model leaves the rest staged until it sends it (a failed call, or destroying the group, discards the
staging). Tied parameters (an ``lm_head`` tied to the embeddings) are one parameter: either name may be sent.
``/update_weights_from_tensor`` (a sender on the same host, :mod:`agentrl.inference.tensor_payload`) stages the same
way, in a staging of its own (:meth:`WeightUpdateGroups.receive_tensors`), except that each call's tensors are
copied before it answers (the sender reuses its memory for the next bucket; the packing follows in the background).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agentrl.failpoints import failpoint
from agentrl.inference import tensor_payload, weight_sync
from agentrl.inference.batching import PreparedWeights
from agentrl.inference.weight_sync import WeightSyncError

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    group: dist.ProcessGroup | None  # None: the staging of /update_weights_from_tensor
    staged: set[str] = field(default_factory=set)  # parameter names received since the last swap
    preparing: asyncio.Task | None = None  # the chain of background preparations of the received buckets
    prepared: PreparedWeights | None = None

    def discard(self) -> None:
        if self.preparing is not None:
            self.preparing.cancel()
        self.staged, self.preparing, self.prepared = set(), None, None


Prepare = Callable[..., PreparedWeights]
"""``prepare(tensors, into, copy=..., pack=...)``: make received tensors ready to serve
(:meth:`ContinuousBatcher.prepare`)."""


class WeightUpdateGroups:
    """The weight-update groups an engine has joined, and what each has staged."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str, timeout_s: float, prepare: Prepare):
        self.device, self.timeout_s, self.prepare = device, timeout_s, prepare
        canonical = {id(param): name for name, param in model.named_parameters()}
        self.names = set(canonical.values())
        """the parameters a version must bring (tied ones once)"""
        self.canonical = {key: canonical[id(tensor)] for key, tensor in model.state_dict(keep_vars=True).items()
                          if id(tensor) in canonical}
        """every state-dict key of a parameter (a tied alias too) -> the parameter's name"""
        self.shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
        self.buffers = {key: tensor for key, tensor in model.state_dict().items() if key not in self.canonical}
        """persistent buffers (no update brings them: they keep their values)"""
        self.groups: dict[str, _Group] = {}
        self.tensors = _Group(None)
        self._mapped: set[torch.UntypedStorage] = set()  # the shared memory of the last tensor update

    async def join(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str) -> None:
        if group_name in self.groups:
            raise WeightSyncError(f"group {group_name!r} exists already: destroy it first")
        if backend == "nccl" and not str(self.device).startswith("cuda"):
            raise WeightSyncError(f"backend nccl needs CUDA; this engine runs on {self.device}: use gloo")
        group = await asyncio.to_thread(weight_sync.init_group, master_address, master_port, rank, world_size,
                                        group_name, backend, self.timeout_s)
        self.groups[group_name] = _Group(group)

    def leave(self, group_name: str) -> None:
        member = self.groups.pop(group_name, None)
        if member is None:
            raise WeightSyncError(f"The group to be destroyed does not exist: {group_name!r}")
        member.discard()
        weight_sync.destroy_group(member.group)

    async def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                      shapes: Sequence[Sequence[int]], load_format: str | None) -> PreparedWeights | None:
        """Receive one update into the group's staging (its preparation for serving goes on in the background,
        while the next bucket travels); the whole new version once every parameter has arrived, else None.
        :class:`WeightSyncError` (staging discarded) when the tensors cannot be received or do not fit the model."""
        member = self.groups.get(group_name)
        if member is None:
            raise WeightSyncError(f"Group {group_name} not in {sorted(self.groups)}. Please call "
                                  "`init_weights_update_group` first.")
        if load_format not in (None, weight_sync.BUCKET_FORMAT):
            raise WeightSyncError(f"load_format {load_format!r} is not supported (none, or "
                                  f"{weight_sync.BUCKET_FORMAT!r})")
        layout = weight_sync.specs(names, dtypes, shapes)
        try:
            received = await asyncio.to_thread(weight_sync.receive, member.group, layout, load_format, self.device)
            failpoint("engine.weight_update.after_receive")
        except Exception as error:
            member.discard()
            raise WeightSyncError(f"receiving {len(layout)} tensor(s) failed (the served weights are unchanged): "
                                  f"{error}") from error
        return await self._stage(member, f"weight update group {group_name}", received)

    async def receive_tensors(self, entry: str, load_format: str | None) -> tuple[int, PreparedWeights | None]:
        """Stage the tensors of a ``/update_weights_from_tensor`` payload entry (views of the sender's memory,
        copied before this returns); how many arrived, and the whole new version as :meth:`receive` returns it.
        :class:`WeightSyncError` (staging discarded) when they cannot be read or do not fit the model."""
        try:
            received = await asyncio.to_thread(
                lambda: tensor_payload.named_tensors(tensor_payload.deserialize(entry), load_format))
        except WeightSyncError:
            self.tensors.discard()
            raise
        # keeping the sender's memory mapped lets the next call find it in torch's cache (no pages to fault in)
        self._mapped = {tensor.untyped_storage() for _, tensor in received if tensor.device.type == "cpu"}
        return len(received), await self._stage(self.tensors, "tensor updates", received, copy=True)

    async def _stage(self, member: _Group, label: str, received: list[tuple[str, torch.Tensor]], *,
                     copy: bool = False) -> PreparedWeights | None:
        try:
            checked = {self._checked(name, tensor): tensor for name, tensor in received}
        except WeightSyncError:
            member.discard()
            raise
        member.staged |= checked.keys()
        if copy:  # the sender reuses its memory once answered: copied now, packed in the background
            try:
                member.prepared = await asyncio.to_thread(self.prepare, checked, member.prepared, copy=True,
                                                          pack=False)
            except Exception as error:
                member.discard()
                raise WeightSyncError(f"copying the tensors failed (the served weights are unchanged): {error}"
                                      ) from error
            checked = {}
        member.preparing = asyncio.create_task(self._prepare_after(member.preparing, member, checked))
        missing = self.names - member.staged
        if missing:
            logger.info("%s: staged %d of %d parameters", label, len(member.staged), len(self.names))
            return None
        try:
            await member.preparing
            complete = await asyncio.to_thread(self.prepare, self.buffers, member.prepared)
        except Exception as error:
            member.discard()
            raise WeightSyncError(f"preparing the new weights failed (the served weights are unchanged): {error}"
                                  ) from error
        member.discard()
        for other in (*self.groups.values(), self.tensors):  # a half-sent version of another sender is older
            other.discard()
        return complete

    async def _prepare_after(self, previous: asyncio.Task | None, member: _Group,
                             tensors: dict[str, torch.Tensor]) -> None:
        if previous is not None:
            await previous
        member.prepared = await asyncio.to_thread(self.prepare, tensors, member.prepared)

    def staged(self, group_name: str | None) -> int:
        """Parameters a group (None: the tensor updates) staged since the last swap."""
        member = self.tensors if group_name is None else self.groups.get(group_name)
        return len(member.staged) if member else 0

    def _checked(self, name: str, tensor: torch.Tensor) -> str:
        canonical = self.canonical.get(name)
        if canonical is None:
            raise WeightSyncError(f"{name}: the served model has no such parameter (the update is dropped)")
        if tuple(tensor.shape) != self.shapes[canonical]:
            raise WeightSyncError(f"{name}: shape {list(tensor.shape)} instead of {list(self.shapes[canonical])} "
                                  "(the update is dropped)")
        if not tensor.dtype.is_floating_point:
            raise WeightSyncError(f"{name}: dtype {weight_sync.dtype_name(tensor.dtype)} is not a floating point "
                                  "type (the update is dropped)")
        return canonical
