"""``python collective_probe.py OUT_DIR TRAINER_FLAGS...`` under torchrun: one trainer rank with its collectives and
weight loading watched; writes ``OUT_DIR/rank<N>.json``.

There is no CUDA on the test machines, so no real NCCL. The stand-in is a checking wrapper around
``torch.distributed``'s tensor collectives: a collective called from AgentRL code must receive tensors made by
``ParallelState.collective_tensor`` — the helper that puts them on the backend's device (``cuda:N`` under NCCL,
which accepts nothing else; its choice is unit-tested separately). A tensor made any other way (e.g.
``torch.tensor(...)`` without a device, a CPU tensor on a GPU run) is a violation, as NCCL would reject it.
Collectives torch itself issues (FSDP2, DTensor, distributed checkpoints) take their tensors from the model's
device and are not checked.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl.training import weights
from agentrl.training.parallel import ParallelState

CHECKED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
           "all_to_all_single", "gather", "scatter")
violations: list[str] = []
calls: Counter[str] = Counter()
loads = 0

_make = ParallelState.collective_tensor


def _marked(self: ParallelState, values, dtype=None) -> torch.Tensor:
    tensor = _make(self, values, dtype)
    tensor._placed_for_collective = True
    return tensor


def _caller() -> str | None:
    """``function<caller>`` of the nearest AgentRL frame, if AgentRL code issued this collective directly."""
    frame = sys._getframe(2)
    if not frame.f_globals.get("__name__", "").startswith("agentrl."):
        return None
    return f"{frame.f_code.co_name}<{frame.f_back.f_code.co_name}"


def _checked(name: str, collective):
    def wrapper(*args, **kwargs):
        site = _caller()
        if site is not None:
            calls[site] += 1
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in (*args, *kwargs.values()) if isinstance(a, list) for t in a
                        if isinstance(t, torch.Tensor)]
            for tensor in tensors:
                if not getattr(tensor, "_placed_for_collective", False):
                    violations.append(f"{name} from {site}: a {tensor.device} tensor not made by "
                                      "ParallelState.collective_tensor")
        return collective(*args, **kwargs)
    return wrapper


def _counted_load(*args, **kwargs):
    global loads
    loads += 1
    return _load(*args, **kwargs)


_load = weights.load_pretrained


def main() -> int:
    out = Path(sys.argv[1])
    ParallelState.collective_tensor = _marked
    for name in CHECKED:
        setattr(dist, name, _checked(name, getattr(dist, name)))
    weights.load_pretrained = _counted_load
    from agentrl.train import main as train

    code = train(sys.argv[2:])
    rank = os.environ.get("RANK", "0")
    (out / f"rank{rank}.json").write_text(json.dumps({"violations": violations, "calls": calls,
                                                       "loads": loads}))
    return code


if __name__ == "__main__":
    sys.exit(main())
