"""Publishing a version of the weights to a live ``agentrl engine``: through disk against in memory, in one run.

    .venv/bin/python bench/publish.py [--model DIR | --model_config FILE] [--device cpu|cuda] [--repeats 5]
                                      [--bucket_mb 256] [--dtype float32] [--json] [--dry_run]

The sender is the trainer's own publishing code in this process (one rank, the model in memory on ``--device``);
the engine serves the same model (on the CPU ``--num_threads 1`` and fp32; on CUDA bf16) and is idle.
``--model_config`` builds a random-weight model of that architecture (the GPU check: the Qwen3-0.6B shape, on
CUDA, NCCL). Each transport publishes ``--repeats`` versions, alternating, and
the table gives medians:

* **disk**: the trainer's ``export_pretrained`` (safetensors, in the publish dtype) into ``weights/<v>``, then
  ``POST /update_weights_from_disk`` (the engine reads the files and swaps): ``--weight_transport disk``;
* **distributed**: the trainer's ``parameter_buckets`` + ``WeightGroups.send`` (``--weight_transport
  distributed``): ``POST /update_weights_from_distributed`` per bucket of at most ``--bucket_mb`` MiB (one dtype a
  bucket, SGLang's ``flattened_bucket``) while the bucket is broadcast over the weight-update group (gloo, joined
  once before timing, as the trainer keeps it for the run); the engine swaps once the last bucket arrived;
* **tensor**: the same buckets through ``TensorSender.send`` (``--weight_transport tensor``): each flattened into a
  shared send buffer (shared memory on the CPU, CUDA IPC on a GPU) that the engine maps and copies, ``POST
  /update_weights_from_tensor`` per bucket.

``send_s`` is the sender's side (writing the files; gathering and broadcasting the buckets), ``service_s`` the rest
until the engine serves the new version. All transports end serving the same weights (the logprobs of a fixed
prompt are compared bit for bit). ``--json`` prints ``{seconds_by_transport, distributed_over_disk,
tensor_over_disk, ...}``; the
figures also go to ``bench/results/publish.json``. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from agentrl.inference import SGLangClient
from agentrl.inference.embedded_model import default_model_path
from agentrl.inference.process import EngineProcess
from agentrl.inference.tiny_model import build_random_model
from agentrl.training.aio import LoopThread
from agentrl.training.parallel import ParallelState
from agentrl.training.weight_transport import TensorSender, WeightGroups, parameter_buckets
from agentrl.training.weights import export_pretrained

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 9, 14, 3, 27, 8, 30, 2]
TRANSPORTS = ("disk", "distributed", "tensor")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--model_config", type=Path, default=None, help="a config.json to build a random model from")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dry_run", action="store_true", help="check the arguments, measure nothing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket_mb", type=float, default=256.0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the publish dtype (the trainer's: bfloat16 when it trains in bf16)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "publish.json")
    return parser.parse_args()


def logprobs(url: str) -> list[float]:
    reply = httpx.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
                       timeout=120).json()
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


def synchronized(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def publish_disk(io: LoopThread, url: str, model: torch.nn.Module, dtype: torch.dtype, root: Path, version: int
                 ) -> dict[str, float]:
    synchronized(model.device.type)
    started = time.perf_counter()
    path = root / str(version)
    export_pretrained(model, ParallelState(), path, dtype=dtype)
    written = time.perf_counter()

    async def load() -> None:
        async with SGLangClient(url) as client:
            await client.update_weights_from_disk(str(path), weight_version=version)

    io.run(load())
    done = time.perf_counter()
    return {"send_s": written - started, "service_s": done - written, "total_s": done - started}


def publish_in_memory(groups: WeightGroups | TensorSender, url: str, model: torch.nn.Module, dtype: torch.dtype,
                      bucket_bytes: int, version: int) -> dict[str, float]:
    synchronized(model.device.type)
    started = time.perf_counter()
    sent = groups.send(parameter_buckets(model, ParallelState(), dtype=dtype, device=model.device,
                                         limit_bytes=bucket_bytes), [url], version)
    if sent.failures:
        raise SystemExit(f"the in-memory publish failed: {sent.failures}")
    broadcast = time.perf_counter()
    sent.last[url].result()
    done = time.perf_counter()
    return {"send_s": broadcast - started, "service_s": done - broadcast, "total_s": done - started}


def measure(args: argparse.Namespace, url: str, model_dir: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    dtype = getattr(torch, args.dtype)
    size_mb = sum(p.numel() for p in model.parameters()) * dtype.itemsize / 2**20
    bucket_bytes = int(args.bucket_mb * 2**20)
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
    served: dict[str, list[float]] = {}
    io = LoopThread("bench-io")
    senders = {"distributed": WeightGroups(io, backend="nccl" if args.device == "cuda" else "gloo", timeout_s=300),
               "tensor": TensorSender(io, timeout_s=300)}
    try:
        for sender in senders.values():
            if (reason := io.run(sender.join(url))) is not None:
                raise SystemExit(reason)
        with tempfile.TemporaryDirectory(prefix="agentrl-publish-") as tmp:
            version = 0
            for _ in range(args.repeats):
                for transport in TRANSPORTS:
                    version += 1
                    if transport == "disk":
                        runs[transport].append(publish_disk(io, url, model, dtype, Path(tmp), version))
                    else:
                        runs[transport].append(publish_in_memory(senders[transport], url, model, dtype,
                                                                 bucket_bytes, version))
                    served[transport] = logprobs(url)
    finally:
        for sender in senders.values():
            sender.close()
        io.close()
    if len({tuple(lps) for lps in served.values()}) != 1:
        raise SystemExit(f"the transports served different weights: {served}")
    buckets = sum(1 for _ in parameter_buckets(model, ParallelState(), dtype=dtype, device=model.device,
                                               limit_bytes=bucket_bytes))
    medians = {t: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for t, rows in runs.items()}
    return {"model": str(model_dir), "device": args.device, "dtype": args.dtype, "size_mb": round(size_mb, 1),
            "repeats": args.repeats, "bucket_mb": args.bucket_mb, "buckets": buckets, "medians": medians, "runs": runs,
            "seconds_by_transport": {t: round(m["total_s"], 3) for t, m in medians.items()},
            **{f"{t}_over_disk": round(medians[t]["total_s"] / medians["disk"]["total_s"], 3)
               for t in TRANSPORTS if t != "disk"}}


def main() -> int:
    args = parse_args()
    if args.model and args.model_config:
        raise SystemExit("give --model or --model_config, not both")
    if args.dry_run:
        print(json.dumps({"dry_run": True, "device": args.device, "dtype": args.dtype, "bucket_mb": args.bucket_mb}))
        return 0
    with tempfile.TemporaryDirectory(prefix="agentrl-publish-model-") as built:
        model_dir = (build_random_model(args.model_config, Path(built) / "model") if args.model_config
                     else args.model or default_model_path())
        flags = (["--device", "cuda", "--dtype", "bfloat16"] if args.device == "cuda"
                 else ["--num_threads", "1", "--dtype", "float32"])
        engine = EngineProcess(model_dir, *flags, "--no_register", "--max_total_tokens", "4096")
        try:
            result = measure(args, engine.url, Path(model_dir))
        finally:
            engine.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
        return 0
    print(f"\nPublishing {Path(result['model']).name} ({result['size_mb']:.0f} MiB {result['dtype']}) to an idle "
          f"engine, medians of {result['repeats']} (buckets of {result['bucket_mb']:g} MiB: {result['buckets']})")
    print("| transport | sender s | service s | total s | vs disk |")
    print("|---|---:|---:|---:|---:|")
    disk = result["medians"]["disk"]["total_s"]
    for transport, m in result["medians"].items():
        print(f"| {transport} | {m['send_s']:.2f} | {m['service_s']:.2f} | {m['total_s']:.2f} | "
              f"{m['total_s'] / disk:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
