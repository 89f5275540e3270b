"""Publishing a version of the weights to a live ``agentrl engine``: through disk against in memory, in one run.

    .venv/bin/python bench/publish.py [--model DIR] [--repeats 5] [--bucket_mb 256] [--json]

The sender is this process holding the model's weights in memory (as a trainer's rank 0 does after gathering
them); the engine serves the same model (``--num_threads 1``, fp32) and is idle. Each transport publishes
``--repeats`` versions, alternating, and the table gives medians:

* **disk**: ``save_pretrained`` (safetensors) into a new directory, then ``POST /update_weights_from_disk`` (the
  engine reads it and swaps): what the trainer does today;
* **distributed**: ``POST /update_weights_from_distributed`` per bucket of at most ``--bucket_mb`` MB (one dtype a
  bucket, SGLang's ``flattened_bucket``), each while this process broadcasts it over the weight-update group (gloo,
  joined once before timing, as a trainer keeps it for the run); the engine swaps when the last bucket arrived;
* **distributed_per_tensor**: the same calls without ``load_format``: one broadcast per tensor.

``send_s`` is the sender's side (writing, or nothing), ``service_s`` the HTTP calls until the engine serves the new
version. Both transports end serving the same weights (the logprobs of a fixed prompt are compared bit for bit).
``--json`` prints ``{seconds_by_transport, distributed_over_disk, ...}``; the figures also go to
``bench/results/publish.json``. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from agentrl.inference import SGLangClient, weight_sync
from agentrl.inference.embedded_model import default_model_path
from agentrl.inference.process import EngineProcess

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 9, 14, 3, 27, 8, 30, 2]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket_mb", type=float, default=256.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "publish.json")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def buckets(named: list[tuple[str, torch.Tensor]], limit_bytes: float) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one dtype, at most ``limit_bytes`` a bucket (a larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0.0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not out or out[-1][-1][1].dtype != tensor.dtype or size + nbytes > limit_bytes:
            out.append([])
            size = 0.0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def logprobs(url: str) -> list[float]:
    reply = httpx.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
                       timeout=120).json()
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


async def publish_disk(client: SGLangClient, model: torch.nn.Module, root: Path, version: int) -> dict[str, float]:
    started = time.perf_counter()
    path = root / str(version)
    await asyncio.to_thread(model.save_pretrained, path, safe_serialization=True)
    written = time.perf_counter()
    await client.update_weights_from_disk(str(path), weight_version=version)
    done = time.perf_counter()
    return {"send_s": written - started, "service_s": done - written, "total_s": done - started}


async def publish_distributed(client: SGLangClient, group: object, named: list[tuple[str, torch.Tensor]],
                              bucket_bytes: float, version: int, load_format: str | None) -> dict[str, float]:
    started = time.perf_counter()
    for bucket in buckets(named, bucket_bytes):
        layout = [weight_sync.TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in bucket]
        call = asyncio.create_task(client.update_weights_from_distributed(
            [s.name for s in layout], [weight_sync.dtype_name(s.dtype) for s in layout],
            [list(s.shape) for s in layout], weight_version=version, load_format=load_format))
        await asyncio.to_thread(weight_sync.send, group, bucket, load_format)
        await call
    done = time.perf_counter()
    return {"send_s": 0.0, "service_s": done - started, "total_s": done - started}


async def measure(args: argparse.Namespace, url: str, model_dir: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = list(model.named_parameters())
    size_mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
    runs: dict[str, list[dict[str, float]]] = {"disk": [], "distributed": [], "distributed_per_tensor": []}
    served: dict[str, list[float]] = {}
    port = free_port()
    async with SGLangClient(url) as client:
        joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo"))
        group = await asyncio.to_thread(weight_sync.init_group, "127.0.0.1", port, 0, 2,
                                        weight_sync.DEFAULT_GROUP, "gloo", 300)
        await joined
        try:
            with tempfile.TemporaryDirectory(prefix="agentrl-publish-") as tmp:
                version = 0
                for _ in range(args.repeats):
                    for transport in runs:
                        version += 1
                        if transport == "disk":
                            runs[transport].append(await publish_disk(client, model, Path(tmp), version))
                        else:
                            load_format = None if transport.endswith("per_tensor") else weight_sync.BUCKET_FORMAT
                            runs[transport].append(await publish_distributed(
                                client, group, named, args.bucket_mb * 2**20, version, load_format))
                        served[transport] = await asyncio.to_thread(logprobs, url)
        finally:
            await client.destroy_weights_update_group()
            weight_sync.destroy_group(group)
    if len({tuple(lps) for lps in served.values()}) != 1:
        raise SystemExit(f"the transports served different weights: {served}")
    medians = {t: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for t, rows in runs.items()}
    return {"model": str(model_dir), "size_mb": round(size_mb, 1), "repeats": args.repeats,
            "bucket_mb": args.bucket_mb, "buckets": len(buckets(named, args.bucket_mb * 2**20)),
            "medians": medians, "runs": runs,
            "seconds_by_transport": {t: round(m["total_s"], 3) for t, m in medians.items()},
            "distributed_over_disk": round(min(medians["distributed"]["total_s"],
                                               medians["distributed_per_tensor"]["total_s"])
                                           / medians["disk"]["total_s"], 3)}


def main() -> int:
    args = parse_args()
    model_dir = args.model or default_model_path()
    engine = EngineProcess(model_dir, "--num_threads", "1", "--dtype", "float32", "--no_register",
                           "--max_total_tokens", "4096")
    try:
        result = asyncio.run(measure(args, engine.url, Path(model_dir)))
    finally:
        engine.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
        return 0
    print(f"\nPublishing {Path(result['model']).name} ({result['size_mb']:.0f} MB fp32) to an idle engine, medians of "
          f"{result['repeats']} (buckets of {result['bucket_mb']:g} MB: {result['buckets']})")
    print("| transport | sender s | service s | total s | vs disk |")
    print("|---|---:|---:|---:|---:|")
    disk = result["medians"]["disk"]["total_s"]
    for transport, m in result["medians"].items():
        print(f"| {transport} | {m['send_s']:.2f} | {m['service_s']:.2f} | {m['total_s']:.2f} | "
              f"{m['total_s'] / disk:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
