"""The compute precision ``--dtype auto`` picks, for the engine and the trainer alike.

``auto`` is bf16 where the hardware multiplies bf16 natively and fp32 elsewhere: on CUDA GPUs with bf16 support
(compute capability 8.0 and later), and on CPUs with bf16 matrix instructions (x86 AMX-BF16 or AVX512-BF16; ARM's
BF16 extension, as oneDNN reports it). Elsewhere bf16 is emulated and slower than fp32, so ``auto`` stays fp32.
On a CPU with AVX512-BF16, a 256×1536 by 1536×1536 matmul runs about 2-5 times faster in bf16 than in fp32:
training, which multiplies hundreds of rows at once, gains. The inference engine's ``auto`` on such a CPU keeps an
fp32 model whose layers multiply in bf16 (``agentrl.inference.engine.bf16_matmuls``).
"""

from __future__ import annotations

import platform
from typing import Literal

import torch

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware (see the module doc)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    if platform.machine().lower() in ("aarch64", "arm64"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_amx_tile_supported",
                                                                          "_is_avx512_bf16_supported"))


def resolve_dtype(name: DtypeName | str, device: torch.device) -> torch.dtype:
    """``torch.bfloat16`` or ``torch.float32`` for ``auto`` (``native_bf16``), else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {name!r}: expected auto, float32, bfloat16 or float16")
    return getattr(torch, name)
