"""Process groups, device mesh, FSDP2 and tensor parallelism for the trainer (``torch.distributed``).

Ranks form a ``(dp, tp)`` mesh: tensor-parallel peers (``parallelize_module``: attention and MLP projections
column/row-wise, embeddings, norms and the LM head replicated) see the same data; data-parallel ranks claim
different samples and shard parameters, gradients and optimiser state with FSDP2 (``fully_shard`` per decoder
layer and on the root). One process without launcher variables needs no process group at all; under ``torchrun``
or ``accelerate launch`` the group uses NCCL on CUDA and gloo on CPU.

FSDP2 *averages* gradients over the data-parallel ranks; the losses are globally normalised sums, so the
trainer multiplies each micro-batch loss by ``dp_size`` (gloo has no pre-multiplied sum to turn averaging off).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

TP_LAYER_PLAN: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
"""Tensor-parallel plan of one decoder layer of Llama/Qwen/Mistral-style models (heads split across ranks)."""


class ParallelError(RuntimeError):
    """The requested parallel layout does not fit the world size or the model."""


@dataclass
class ParallelState:
    """Where this process sits: global rank, data-parallel and tensor-parallel coordinates, device, groups."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None  # torch DeviceMesh with dims ("dp", "tp"), None without a process group

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_tp_leader(self) -> bool:
        """The rank of its tensor-parallel group that talks to the store for the group."""
        return self.tp_rank == 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.distributed else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["tp"].get_group() if self.distributed else None

    # ------------------------------------------------------------------------------------------ collectives

    def all_reduce(self, values: list[float], op: str = "sum", group: str = "world") -> list[float]:
        """``values`` reduced (``sum``, ``max`` or ``min``) over the world or the ``dp`` group; unchanged alone."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op, group=self.dp_group if group == "dp" else None)
        return tensor.tolist()

    def broadcast_from_tp_leader(self, obj: Any) -> Any:
        """The tensor-parallel leader's ``obj`` on every rank of its tensor-parallel group."""
        if not self.distributed or self.tp_size == 1:
            return obj
        box = [obj]
        group = self.tp_group
        dist.broadcast_object_list(box, group_src=0, group=group)
        return box[0]

    def broadcast_from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


ACCELERATE_TP_VAR = "PARALLELISM_CONFIG_TP_SIZE"


def resolve_tp_size(flag: int | None) -> int:
    """``--tp_size``, else the TP degree of an ``accelerate launch`` config (``parallelism_config_tp_size``),
    else 1; the two must agree when both are set."""
    launched = os.environ.get(ACCELERATE_TP_VAR) if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") else None
    if launched is not None and flag is not None and int(launched) != flag:
        raise ParallelError(f"--tp_size {flag} disagrees with the accelerate config's parallelism_config_tp_size "
                            f"{launched}")
    return flag if flag is not None else int(launched or 1)


def init_parallel(tp_size: int = 1, backend: str | None = None, timeout_s: int = 1800) -> ParallelState:
    """Join the launcher's process group (if any) and build the ``(dp, tp)`` mesh.

    Without ``RANK``/``WORLD_SIZE`` in the environment (a plain ``python -m agentrl.train``) this is one process
    on ``cuda`` if available, else ``cpu``, and ``tp_size`` must be 1.
    """
    cuda = torch.cuda.is_available()
    if not all(name in os.environ for name in LAUNCHER_VARS):
        if tp_size != 1:
            raise ParallelError(f"--tp_size {tp_size} needs {tp_size} processes: launch with torchrun "
                                f"--nproc_per_node {tp_size} or accelerate launch")
        return ParallelState(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size % tp_size:
        raise ParallelError(f"world size {world_size} is not a multiple of --tp_size {tp_size}")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if cuda else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if cuda else None)
    dp_size = world_size // tp_size
    mesh = init_device_mesh(device.type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    state = ParallelState(rank=rank, world_size=world_size, dp_rank=mesh["dp"].get_local_rank(), dp_size=dp_size,
                          tp_rank=mesh["tp"].get_local_rank(), tp_size=tp_size, device=device, mesh=mesh)
    logger.debug("rank %d of %d: dp %d/%d, tp %d/%d on %s (%s)", rank, world_size, state.dp_rank, dp_size,
                 state.tp_rank, tp_size, device, backend)
    return state


def shutdown_parallel(state: ParallelState) -> None:
    if state.distributed and dist.is_initialized():
        dist.destroy_process_group()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` for Llama/Qwen/Mistral...)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ParallelError(f"{type(model).__name__}: cannot find its decoder layers (expected "
                            f"{model.base_model_prefix}.layers) to shard")
    return layers


def apply_tensor_parallel(model: nn.Module, state: ParallelState) -> None:
    """Split attention heads and MLP columns of every decoder layer over the ``tp`` mesh dimension."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % state.tp_size:
            raise ParallelError(f"--tp_size {state.tp_size} does not divide the model's {name} ({value})")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):
        plan = {}
        for path, style in TP_LAYER_PLAN.items():
            try:
                layer.get_submodule(path)
            except AttributeError as error:
                raise ParallelError(f"{type(model).__name__} has no {path} in its decoder layers: tensor "
                                    "parallelism supports Llama/Qwen/Mistral-style layers") from error
            plan[path] = styles[style]()
        parallelize_module(layer, state.mesh["tp"], plan)


def shard_model(model: nn.Module, state: ParallelState, *, bf16: bool, reshard_after_forward: bool = True) -> None:
    """Apply tensor parallelism (``tp_size > 1``) and FSDP2 over ``dp`` to ``model``, in place.

    Parameters stay fp32 (master weights); with ``bf16`` FSDP2 computes in bf16 and reduces gradients in fp32.
    """
    if not state.distributed:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if state.tp_size > 1:
        apply_tensor_parallel(model, state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    dp_mesh = state.mesh["dp"]
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm of the gradients (sharded or replicated DTensors or plain tensors), clipped to ``max_norm``.

    Each gradient's norm is computed on its own layout and made whole (so replicated tensor-parallel copies are
    counted once), then the gradients are scaled by ``max_norm / norm`` when that is below 1.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.square())
    total = float(torch.stack(squares).sum().sqrt())
    if not math.isfinite(total):
        raise FloatingPointError(f"the gradient norm is {total}: the step's gradients are not finite")
    if max_norm is not None and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return total
