"""The engine's decode-group attention call, alone: its cost per call as the keys grow by one token a step.

    python bench/decode_attention.py [--device cuda] [--requests 16 64] [--steps 40] [--json FILE]

The engine attends its decoding requests together in one SDPA call per layer (``agentrl.inference.paged_attention``):
queries ``[requests, kv_heads, heads per kv head, dim]``, keys and values gathered into a padded
``[requests, kv_heads, longest, dim]`` view, a padding mask ``[requests, 1, 1, longest]``. ``longest`` grows by one
every decode step. This times that call (Qwen3-0.6B's heads, bf16 on CUDA, fp32 on CPU) over ``--steps``
consecutive lengths, per SDPA backend, with the exact length and with the length rounded up to 64
(``paged_attention.DECODE_KEY_BUCKET``), ``--layers`` calls per step as in a forward pass. ``host`` is the time
until the calls return (launch and kernel choice), ``wall`` until the device has finished them; medians over the
steps. The baseline is the engine's setting for the device. Measured on an H200: the exact length costs 1.5 ms a
call at 64 requests (the kernel is chosen again for each new shape), rounded up 0.04 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from agentrl.inference.paged_attention import DECODE_KEY_BUCKET

KV_HEADS, GROUP, HEAD_DIM = 8, 2, 128  # Qwen3-0.6B: 16 query heads over 8 key/value heads of 128
BACKENDS = {"cuda": {"default": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH],
                     "cudnn": [SDPBackend.CUDNN_ATTENTION]},
            "cpu": {"default": None, "flash": [SDPBackend.FLASH_ATTENTION], "math": [SDPBackend.MATH]}}
"""The SDPA backends timed per device type (``default``: SDPA's own choice, what the engine gets)."""
BUCKETS = (1, 64)


def decode_inputs(requests: int, longest: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """Queries, gathered keys and values as the engine lays them out, and a padding mask of random lengths."""
    query = torch.randn(requests, GROUP, KV_HEADS, HEAD_DIM, device=device, dtype=dtype).transpose(1, 2).contiguous()
    gathered = (requests, longest, KV_HEADS, HEAD_DIM)
    key = torch.randn(requests * longest, KV_HEADS, HEAD_DIM, device=device, dtype=dtype).view(gathered)
    value = torch.randn_like(key)
    lengths = torch.randint(max(1, longest // 2), longest + 1, (requests,), device=device)
    lengths[0] = longest
    mask = (torch.arange(longest, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    return query, key.transpose(1, 2), value.transpose(1, 2), mask


def time_steps(requests: int, first: int, steps: int, layers: int, backends: list | None, bucket: int,
               device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Median ms a call (host, wall) over ``steps`` consecutive key lengths from ``first``."""
    host, wall = [], []
    for length in range(first, first + steps):
        inputs = decode_inputs(requests, -(-length // bucket) * bucket, device, dtype)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with sdpa_kernel(backends) if backends else nullcontext():
            for _ in range(layers):
                torch.nn.functional.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3])
        returned = time.perf_counter()
        sync()
        host.append((returned - start) / layers * 1e3)
        wall.append((time.perf_counter() - start) / layers * 1e3)
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--first", type=int, default=200, help="the first key length timed")
    parser.add_argument("--steps", type=int, default=40, help="consecutive key lengths timed")
    parser.add_argument("--layers", type=int, default=28, help="calls per step (a forward pass's layers)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--dry_run", action="store_true", help="check the arguments, measure nothing")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine_bucket = DECODE_KEY_BUCKET.get(device.type, 1)
    backends = BACKENDS[device.type]
    if args.dry_run:
        print(f"dry run: {device} {dtype}, requests {args.requests}, backends {list(backends)}, buckets {BUCKETS}")
        return 0
    results = []
    for requests in args.requests:
        for name, chosen in backends.items():
            for bucket in BUCKETS:
                row = {"requests": requests, "backend": name, "bucket": bucket}
                try:
                    time_steps(requests, args.first // 2, 3, args.layers, chosen, bucket, device, dtype)  # warm-up
                    row |= time_steps(requests, args.first, args.steps, args.layers, chosen, bucket, device, dtype)
                except RuntimeError as error:  # a backend that cannot serve these inputs
                    row["error"] = str(error).splitlines()[0][:120]
                results.append(row)
    print(f"\ndevice {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
          f"torch {torch.__version__}; the engine rounds to {engine_bucket}\n")
    print("| requests | backend | key length rounded to | host ms/call | wall ms/call | wall vs the engine's |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in results:
        base = next(r for r in results if (r["requests"], r["backend"], r["bucket"]) ==
                    (row["requests"], "default", engine_bucket))
        cells = (f"{row['error']} | |" if "error" in row else
                 f"{row['host_ms']:.3f} | {row['wall_ms']:.3f} | {row['wall_ms'] / base['wall_ms']:.2f}x")
        print(f"| {row['requests']} | {row['backend']} | {row['bucket']} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                               "engine_bucket": engine_bucket, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
