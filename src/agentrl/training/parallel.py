"""Process groups, device mesh, FSDP2 and tensor parallelism for the trainer (``torch.distributed``).

Ranks form a ``(dp, tp)`` mesh: tensor-parallel peers (``parallelize_module``: attention and MLP projections
column/row-wise, embeddings, norms and the LM head replicated) see the same data; data-parallel ranks claim
different samples and shard parameters, gradients and optimiser state with FSDP2 (``fully_shard`` per decoder
layer and on the root; a vision-language model's vision blocks and tower too, the tower run in every pass:
``agentrl.training.vision_parallel``). One process without launcher variables needs no process group at all;
under ``torchrun`` or ``accelerate launch`` the group uses NCCL on CUDA and gloo on CPU.

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

from agentrl.training.vision_parallel import BlankPicturePass, vision_blocks, vision_language_model

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
    def backend(self) -> str | None:
        """The process group's backend (``nccl``, ``gloo``...), None without a process group."""
        return dist.get_backend() if self.distributed else None

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

    @property
    def collective_device(self) -> torch.device:
        """Where a tensor handed to a collective must live: the rank's CUDA device under NCCL (which accepts no
        CPU tensor), the CPU under gloo. Every trainer collective builds its tensors with ``collective_tensor``."""
        return backend_device(self.backend or "gloo", self.device)

    def collective_tensor(self, values: list[float] | torch.Tensor, dtype: torch.dtype | None = None
                          ) -> torch.Tensor:
        """A new tensor holding ``values`` on ``collective_device`` (float64 for a list): the one way trainer code
        makes the inputs of its collectives."""
        if isinstance(values, torch.Tensor):
            return values.to(device=self.collective_device, dtype=dtype or values.dtype, copy=True)
        return torch.tensor(values, dtype=dtype or torch.float64, device=self.collective_device)

    def all_reduce(self, values: list[float], op: str = "sum", group: str = "world") -> list[float]:
        """``values`` reduced (``sum``, ``max`` or ``min``) over the world or the ``dp`` group; unchanged alone."""
        if not self.distributed:
            return list(values)
        tensor = self.collective_tensor(values)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(tensor, op=reduce_op, group=self.dp_group if group == "dp" else None)
        return tensor.tolist()

    def broadcast_from_tp_leader(self, obj: Any) -> Any:
        """The tensor-parallel leader's ``obj`` on every rank of its tensor-parallel group."""
        if not self.distributed or self.tp_size == 1:
            return obj
        box = [obj]
        group = self.tp_group
        dist.broadcast_object_list(box, group_src=0, group=group, device=self.collective_device)
        return box[0]

    def broadcast_from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.collective_device)
        return box[0]

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0 (None on the others)."""
        if not self.distributed:
            return [obj]
        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def backend_device(backend: str, device: torch.device) -> torch.device:
    """The device whose tensors ``backend`` reduces: ``device`` (CUDA) for NCCL, the CPU for gloo; a mixed
    backend such as ``cpu:gloo,cuda:nccl`` takes ``device``."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        raise ParallelError(f"the NCCL backend reduces CUDA tensors only, but this rank computes on {device}")
    return device


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
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` for Llama/Qwen/Mistral...), or of a
    vision-language model's language model (``model.model.language_model.layers`` for Qwen-VL)."""
    vlm = vision_language_model(model)
    base = vlm.language_model if vlm is not None else getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ParallelError(f"{type(model).__name__}: cannot find its decoder layers (expected "
                            f"{model.base_model_prefix}.layers) to shard")
    return layers


def apply_tensor_parallel(model: nn.Module, state: ParallelState) -> None:
    """Split attention heads and MLP columns of every decoder layer over the ``tp`` mesh dimension (a
    vision-language model's language model; its vision tower is replicated, as the peers see the same data)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = getattr(model.config, "text_config", None) or model.config
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

    Parameters stay fp32 (master weights). With ``bf16`` the decoder layers compute in bf16 and reduce gradients
    in fp32, while the root group (embeddings, final norm, LM head) keeps fp32 parameters: the logits that feed
    the logprobs are fp32; a vision tower computes as the decoder layers do. Works on a meta-device model too
    (``materialize_from_main`` fills it afterwards).
    """
    if not state.distributed:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if state.tp_size > 1:
        apply_tensor_parallel(model, state)
    layer_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    dp_mesh = state.mesh["dp"]
    vlm = vision_language_model(model)
    if vlm is not None:  # each vision block, then the rest of the tower (patch embedding, mergers): units of their own
        for block in vision_blocks(model) or ():
            fully_shard(block, mesh=dp_mesh, mp_policy=layer_policy, reshard_after_forward=reshard_after_forward)
        fully_shard(vlm.visual, mesh=dp_mesh, mp_policy=layer_policy, reshard_after_forward=reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=layer_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    if vlm is not None:
        BlankPicturePass(model)  # every rank runs the tower in every pass (agentrl.training.vision_parallel)


def materialize_from_main(model: nn.Module, state: ParallelState, source: nn.Module | None) -> None:
    """Fill ``model`` (sharded on the meta device) with ``source``'s weights, which only rank 0 holds.

    Parameters and persistent buffers are broadcast from rank 0 straight into each rank's shards
    (``set_model_state_dict`` with ``broadcast_from_rank0``); the tensors a model computes at construction and
    does not save (rotary ``inv_freq``...) are broadcast one by one. Every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=state.device)
    full = source.state_dict() if state.is_main else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    sources = dict(_unsaved_tensors(source)) if state.is_main else {}
    for (module, name), tensor in _unsaved_tensors(model):
        received = state.collective_tensor(sources[(module, name)] if state.is_main
                                           else torch.zeros(tensor.shape, dtype=tensor.dtype))
        dist.broadcast(received, src=0)
        setattr(model.get_submodule(module), name, received.to(state.device))


def _unsaved_tensors(model: nn.Module) -> list[tuple[tuple[str, str], torch.Tensor]]:
    """Non-persistent buffers and plain tensor attributes of ``model``'s modules, in a fixed order."""
    found = []
    for module_name, module in model.named_modules():
        unsaved = set(module._non_persistent_buffers_set)
        for name, value in sorted(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                found.append(((module_name, name), value))
        for name in sorted(unsaved):
            if module._buffers.get(name) is not None:
                found.append(((module_name, name), module._buffers[name]))
    return found


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float | None, state: ParallelState) -> float:
    """Global L2 norm of the gradients (sharded or replicated DTensors or plain tensors), clipped to ``max_norm``.

    One fused norm per gradient layout (device mesh and placements) over the local shards
    (``torch.nn.utils.get_total_norm``), each squared norm divided by the number of ranks holding the same
    values (replicas: tensor-parallel copies count once), then one all-reduce over the world for all of them.
    ``torch.nn.utils.clip_grads_with_norm_`` then scales each layout's gradients by ``max_norm / norm`` when that
    is below 1.
    """
    from torch.distributed.tensor import DTensor, Shard

    by_layout: dict[Any, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            grad = param.grad
            layout = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            by_layout.setdefault(layout, []).append(param)
    if not by_layout:
        return 0.0
    squares = []
    for layout, params in by_layout.items():
        local = [p.grad.to_local() if layout is not None else p.grad for p in params]
        shards = 1
        if layout is not None:
            mesh, placements = layout
            shards = math.prod(mesh.size(dim) for dim, placement in enumerate(placements)
                               if isinstance(placement, Shard))
        replicas = state.world_size / shards
        squares.append(float(torch.nn.utils.get_total_norm(local, norm_type=2.0)) ** 2 / replicas)
    total = math.sqrt(state.all_reduce([math.fsum(squares)])[0])
    if not math.isfinite(total):
        raise FloatingPointError(f"the gradient norm is {total}: the step's gradients are not finite")
    if max_norm is not None and total > max_norm:
        norm = torch.tensor(total)
        for params in by_layout.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return total
