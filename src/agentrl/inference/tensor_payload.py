"""SGLang's ``/update_weights_from_tensor`` payload, both ends: tensors shared with a process on the same host.

SGLang serializes ``serialized_named_tensors`` with its ``MultiprocessingSerializer``: torch's ``ForkingPickler``,
base64 over HTTP, one entry per tensor-parallel rank (the ``agentrl engine`` is one rank). Only metadata crosses
HTTP: a CUDA tensor travels as its CUDA IPC handle, a CPU tensor as the name of its shared-memory segment (torch's
``file_system`` sharing strategy, which :func:`share_for_sending` selects: the default ``file_descriptor`` strategy
passes descriptors over a connection only related processes can open). The receiver maps the same memory, so the
sender must keep the tensors unchanged until the call has answered, and the receiver copies what it keeps
(:func:`named_tensors` returns views of the sender's memory).

Forms (``load_format``): none or ``"direct"``, a list of ``(name, tensor)``; ``"flattened_bucket"``,
``{"flattened_tensor": uint8 tensor, "metadata": [...]}`` whose entries have SGLang's ``FlattenedTensorMetadata``
attributes (``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``). We send them as
``types.SimpleNamespace``, which SGLang's unpickler admits, so our trainer updates a real SGLang too.

Unpickling runs code named in the payload, so :func:`deserialize` admits only the globals these forms need
(SGLang's ``SafeUnpickler`` does the same with a longer list): containers, torch dtypes and sizes, torch's tensor
and storage rebuild functions for shared memory and CUDA IPC, and SGLang's metadata classes (read as
``SimpleNamespace``). Anything else is refused with the name of the global.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import types
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from agentrl.inference.weight_sync import BUCKET_FORMAT, TensorSpec, WeightSyncError


class _SGLangObject(types.SimpleNamespace):
    """What SGLang's payload classes (``FlattenedTensorMetadata``, ``LocalSerializedTensor``) unpickle into."""


_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
}
_ALLOWED = {
    *(("builtins", name) for name in ("list", "tuple", "dict", "str", "int", "float", "bool", "bytes")),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "_reconstructor"),
    ("builtins", "object"), ("types", "SimpleNamespace"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    *(("torch.multiprocessing.reductions", name) for name in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
        "rebuild_storage_empty")),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _SGLangObject
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise WeightSyncError(f"serialized_named_tensors: {module}.{name} is not allowed in a tensor payload")


def share_for_sending(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` (a send buffer kept for the run) in memory another process on this host can map: shared memory
    on the CPU (the ``file_system`` strategy), CUDA memory as it is."""
    if buffer.device.type == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
        _start_shm_manager()
        buffer.share_memory_()
    return buffer


def _start_shm_manager() -> None:
    """Start torch's ``torch_shm_manager`` (it outlives this process while a receiver maps a segment) with stderr
    on ``/dev/null``: it inherits stderr, and a caller reading this process's output would wait for it."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        torch.empty(1, dtype=torch.uint8).share_memory_()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def serialize_bucket(flat: torch.Tensor, layout: Sequence[TensorSpec]) -> str:
    """A ``flattened_bucket`` payload entry for ``flat`` (a view of a :func:`share_for_sending` buffer)."""
    metadata = [types.SimpleNamespace(name=spec.name, shape=torch.Size(spec.shape), dtype=spec.dtype,
                                      start_idx=spec.start, end_idx=spec.end, numel=spec.end - spec.start)
                for spec in layout]
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buffer.getvalue()).decode()


def deserialize(entry: str) -> Any:
    """One ``serialized_named_tensors`` entry, unpickled with the allow-list (:class:`WeightSyncError` if refused)."""
    try:
        data = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as error:
        raise WeightSyncError(f"serialized_named_tensors: not base64: {error}") from error
    return _load(data)


def _load(data: bytes) -> Any:
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except WeightSyncError:
        raise
    except Exception as error:
        raise WeightSyncError(f"serialized_named_tensors: cannot read the tensors ({type(error).__name__}: "
                              f"{error}); the sender must be on this host and keep them until the answer") from error


def named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The payload's tensors as ``(name, tensor)``: views of the sender's memory, to be copied before answering."""
    if load_format == BUCKET_FORMAT:
        if not isinstance(payload, dict) or not isinstance(payload.get("flattened_tensor"), torch.Tensor):
            raise WeightSyncError("a flattened_bucket payload is a dict with flattened_tensor and metadata")
        flat = payload["flattened_tensor"]
        out = []
        for meta in payload.get("metadata") or []:
            try:
                span = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(tuple(meta.shape))
                out.append((str(meta.name), span))
            except (AttributeError, RuntimeError, TypeError) as error:
                raise WeightSyncError(f"flattened_bucket metadata {meta!r} does not fit the bucket: {error}"
                                      ) from error
        return out
    if load_format not in (None, "direct"):
        raise WeightSyncError(f"load_format {load_format!r} is not supported (none, direct or {BUCKET_FORMAT!r})")
    if not isinstance(payload, list | tuple) or not all(isinstance(item, list | tuple) and len(item) == 2
                                                        for item in payload):
        raise WeightSyncError("a tensor payload is a list of (name, tensor) pairs")
    out = []
    for name, tensor in payload:
        if isinstance(tensor, _SGLangObject) and isinstance(getattr(tensor, "values", None), list):
            tensor = _load(bytes(tensor.values[0]))  # SGLang's LocalSerializedTensor: one entry per rank
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"{name}: {type(tensor).__name__} instead of a tensor")
        out.append((str(name), tensor))
    return out
