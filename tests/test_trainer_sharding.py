"""Sharded-model pieces on two gloo ranks: the gradient norm (one collective, exact for FSDP2 and tensor-parallel
layouts) and the backend's collective device."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from agentrl.training.parallel import ParallelError, ParallelState, backend_device, clip_grad_norm, shard_model
from training_core_fixtures import tiny_llama

pytestmark = pytest.mark.slow

MAX_NORM = 0.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _backward(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()


def _rank(rank: int, port: int, tp_size: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from agentrl.training.parallel import init_parallel

    state = init_parallel(tp_size=tp_size)
    try:
        model = tiny_llama(seed=0)
        shard_model(model, state, bf16=False)
        _backward(model)
        counts = {"dist": 0, "full_tensor": 0}
        all_reduce, full_tensor = dist.all_reduce, DTensor.full_tensor

        def counted_all_reduce(*args, **kwargs):
            counts["dist"] += 1
            return all_reduce(*args, **kwargs)

        def counted_full_tensor(self, *args, **kwargs):
            counts["full_tensor"] += 1
            return full_tensor(self, *args, **kwargs)

        dist.all_reduce, DTensor.full_tensor = counted_all_reduce, counted_full_tensor
        norm = clip_grad_norm(list(model.parameters()), MAX_NORM, state)
        dist.all_reduce, DTensor.full_tensor = all_reduce, full_tensor
        clipped = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"norm": norm, "counts": counts, "clipped": clipped}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp_size", [1, 2], ids=["fsdp2", "tensor-parallel"])
def test_gradient_norm_is_one_collective_and_exact(tp_size: int, tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(_free_port(), tp_size, str(out)), nprocs=2, join=True)
    result = torch.load(out)
    model = tiny_llama(seed=0)
    _backward(model)
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    assert expected > MAX_NORM, "the test must clip"
    assert result["norm"] == pytest.approx(expected, rel=1e-5)
    assert result["counts"] == {"dist": 1, "full_tensor": 0}, "one all-reduce for the whole norm"
    for name, param in model.named_parameters():
        assert torch.allclose(result["clipped"][name], param.grad, atol=1e-6), name


def test_collectives_live_on_the_backends_device() -> None:
    assert backend_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert backend_device("gloo", torch.device("cuda", 3)) == torch.device("cpu")
    assert backend_device("cpu:gloo,cuda:nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ParallelError, match="NCCL"):
        backend_device("nccl", torch.device("cpu"))
    assert ParallelState().collective_tensor([1.0, 2.0]).device == torch.device("cpu")
