"""CPU kernels that depend on the row count, emulated where this machine's do not.

oneDNN and PyTorch's CPU SDPA choose their kernels by the CPU's matrix units (AVX-512, AVX512-BF16, AMX tiles),
the threads and the call's row count, and two kernels sum in different orders: the same row can get other last
bits beside other rows. On a Xeon with AMX the embedded model's second identical greedy request answered
otherwise than the first (a prompt computed with its first pages cached); the AVX-512 machines these tests run on
show no such dependence for the packed layers, so the tests force it: each emulation wraps the real kernel and
moves its results one float step (``nextafter``) for the calls that would take "the other kernel". This is the
one failure we cannot produce on the machines we have (say so wherever it is used)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch

from agentrl.inference import packed_linear

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def one_step_up(out: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(out, torch.full_like(out, math.inf))


def count_kernel(rows_below: int, real: Kernel) -> Kernel:
    """A matmul whose calls of fewer than ``rows_below`` rows take "another kernel" (as AMX tiles of 16 rows and
    the AVX512-BF16 kernel beside them might)."""

    def kernel(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = real(rows, packed, bias)
        return one_step_up(out) if rows.numel() // rows.shape[-1] < rows_below else out  # rows: [..., m, in]

    return kernel


def single_row_kernel(real: Kernel) -> Kernel:
    """A matmul whose one-row calls sum in another order (oneDNN's one-row kernel, measured on AVX-512)."""
    return count_kernel(2, real)


def position_kernel(real: Kernel) -> Kernel:
    """A matmul whose odd rows of a call come out otherwise than its even ones: no layout can make it exact."""

    def kernel(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = real(rows, packed, bias).clone()
        out[1::2] = one_step_up(out[1::2])
        return out

    return kernel


@pytest.fixture
def emulate_matmul(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[Kernel], Kernel]], None]]:
    """``emulate_matmul(make)``: every packed layer's kernel call goes through ``make(real kernel)`` (and the probed
    row layouts are forgotten before and after, so the probe sees the emulation)."""

    def emulate(make: Callable[[Kernel], Kernel]) -> None:
        packed_linear.row_layout.cache_clear()
        monkeypatch.setattr(packed_linear, "packed_matmul", make(packed_linear.packed_matmul))

    yield emulate
    packed_linear.row_layout.cache_clear()


def long_query_sdpa(rows_from: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA whose calls of ``rows_from`` query rows or more take "another kernel" (PyTorch's CPU flash attention
    splits queries in blocks of 32, 64 or 256 rows by the call's length)."""
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = real(query, *args, **kwargs)
        return one_step_up(out) if query.shape[-2] >= rows_from else out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
