"""CUDA paths: the engine in bf16, a trainer step under NCCL with FSDP2, LoRA adapters published to an engine on the
GPU, a QLoRA step, the bf16 head, the paged decode kernel, the captured decode steps and a Qwen2.5-VL-3B shape with
pictures. Marker ``gpu``; every test
skips without a CUDA device. ``scripts/gpu_check.sh`` runs them (``pytest -m gpu tests/test_gpu.py``) on a GPU
machine; the rest of the suite covers the same code on CPU.

The model is the tests' scripted model (two layers, trained in code on the calculator scripts, seconds on a GPU):
its distributions are peaked like a real policy's, so logprob gaps mean something. Bounds: bf16 layers against fp32
logprobs stay within the CPU precision test's 0.02 mean nats (``test_trainer_precision.BF16_MEAN_BOUND``); fp32 on
CUDA (no TF32 for matmuls, torch's default) within 1e-3 of fp32.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import uuid
from pathlib import Path

import pytest
import torch

from agentrl.inference import SGLangClient
from agentrl.inference.consistency import logprob_mismatch
from agentrl.store import DBRecordData, Store, sync_client
from conftest import with_database
from inference_fixtures import start_engine
from scripted_model import SCRIPTS
from trainer_fixtures import enqueue, make_samples, run_trainer, trainer_args

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_MEAN_BOUND = 0.02
FP32_CUDA_ATOL = 1e-3


def record_figures(name: str, figures: dict) -> None:
    """Print the figures (the GPU check's log keeps them) on one line a test."""
    print(f"GPU-FIGURES {name} {json.dumps(figures)}")


def prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": s.question}], add_generation_prompt=True,
                                          return_dict=False) for s in SCRIPTS]


async def sampled(url: str, prompt_ids: list[list[int]], max_new_tokens: int = 40, lora_path: str | None = None):
    async with SGLangClient(url) as client:
        return await asyncio.gather(*[client.generate(
            ids, {"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": i}, lora_path=lora_path)
            for i, ids in enumerate(prompt_ids)])


def fp32_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()


def test_engine_generates_with_logprobs_in_bf16(scripted_model_dir: Path) -> None:
    engine = start_engine(scripted_model_dir, "--device", "cuda", "--dtype", "bfloat16")
    try:
        assert "bfloat16" in engine.output and "cuda" in engine.output, engine.output
        ids = prompts(scripted_model_dir)
        results = asyncio.run(sampled(engine.url, ids))
    finally:
        engine.stop()
    model = fp32_model(scripted_model_dir)
    gaps = [logprob_mismatch(model, prompt, r.output_ids, r.output_token_logprobs) for prompt, r in zip(ids, results)]
    mean = statistics.fmean(g["mean_abs_diff"] for g in gaps)
    record_figures("engine_bf16", {"mean_abs_diff": mean, "max_abs_diff": max(g["max_abs_diff"] for g in gaps),
                                   "tokens": sum(len(r.output_ids) for r in results)})
    assert all(r.output_ids for r in results)
    assert mean < BF16_MEAN_BOUND, gaps


def engine_samples(url: str, model_dir: Path) -> list[DBRecordData]:
    """Completions sampled by the engine at ``url``, as queued samples carrying its logprobs."""
    ids = prompts(model_dir)
    return as_samples(ids, asyncio.run(sampled(url, ids)))


def as_samples(prompt_ids: list[list[int]], results: list, images: list[list[str]] | None = None
               ) -> list[DBRecordData]:
    """Queued samples of the engine's completions of ``prompt_ids`` (advantages -1, +1, ... in turn), each with
    its prompt's images (sha256) if given."""
    samples = []
    for i, (prompt, result) in enumerate(zip(prompt_ids, results, strict=True)):
        output = result.output_ids
        samples.append(DBRecordData(
            id=f"s{i}", record_id=f"r{i}", task_id="t", seq=i, input_ids=list(prompt) + output,
            loss_mask=[0] * len(prompt) + [1] * len(output),
            logprobs=[0.0] * len(prompt) + list(result.output_token_logprobs),
            versions=[-1] * len(prompt) + [0] * len(output),
            advantages=[0.0] * len(prompt) + [1.0 if i % 2 else -1.0] * len(output),
            turn_boundaries=[0], images=images[i] if images else [], num_tokens=len(prompt) + len(output)))
    return samples


def test_fsdp2_trainer_step_under_nccl_matches_the_bf16_engine(scripted_model_dir: Path, mongo_server_uri: str,
                                                               tmp_path: Path) -> None:
    """World size 1 under torchrun: NCCL, FSDP2 with bf16 layers (``--dtype auto``, the default) and the fp32
    logprob head; its logprobs of the engine's samples (before the update) are within the bf16 bound of the
    engine's own."""
    engine = start_engine(scripted_model_dir, "--device", "cuda", "--dtype", "bfloat16")
    try:
        samples = engine_samples(engine.url, scripted_model_dir)
    finally:
        engine.stop()
    name = "t_" + uuid.uuid4().hex[:12]
    uri = with_database(mongo_server_uri, name)
    asyncio.run(enqueue(uri, samples))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    done = run_trainer(trainer_args(uri, scripted_model_dir, tmp_path / "out", "--train_batch_size",
                                    str(len(samples)), "--enable_sampling", "false", "--max_steps", "1",
                                    "--save_steps", "0", dtype=None), launcher=launcher, timeout_s=300)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "(nccl, bf16)" in done.stdout, done.stdout[-4000:]
    client = sync_client(uri)
    try:
        db = client[name]
        values = db.Metric.find_one({"step": 1})["values"]
        docs = list(db.DBRecordData.find({}, {"trainer_logprobs": 1, "logprobs": 1, "loss_mask": 1}))
        client.drop_database(name)
    finally:
        client.close()
    gaps = [abs(t - e) for d in docs for t, e, m in zip(d["trainer_logprobs"], d["logprobs"], d["loss_mask"]) if m]
    record_figures("fsdp2_nccl_bf16", {"logprob_mismatch_mean": values["logprob_mismatch_mean"],
                                       "trainer_vs_engine_mean": statistics.fmean(gaps), "max": max(gaps),
                                       "loss": values["loss"], "grad_norm": values["grad_norm"]})
    assert values["logprob_mismatch_mean"] < BF16_MEAN_BOUND, values
    assert statistics.fmean(gaps) < BF16_MEAN_BOUND
    assert values["grad_norm"] > 0 and torch.isfinite(torch.tensor(values["loss"]))


def test_lora_adapters_are_published_to_the_gpu_engine_and_sampled(db_uri: str, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """The trainer on CUDA publishes each version as an adapter into a live engine on CUDA (fp32); a sampler's
    pool sends the Run's adapter, and the engine's logprobs are the trainer's merged final model's."""
    from agentrl.rollout.inference_pool import InferencePool
    from agentrl.train import main

    engine = start_engine(tiny_model_dir, "--device", "cuda", "--dtype", "float32", "--enable_lora",
                          "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    prompt = prompts(tiny_model_dir)[0]
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
        out = tmp_path / "out"
        assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                                 "--save_steps", "0", "--use_peft", "--lora_target_modules", "all-linear",
                                 "--lora_publish", "adapter")) == 0

        async def sample():
            async with Store(db_uri) as store:
                pool = InferencePool(store, wait_for_service_s=60)
                try:
                    result, _ = await pool.generate(prompt, {"max_new_tokens": 8, "temperature": 0,
                                                             "ignore_eos": True})
                finally:
                    await pool.close()
            return result

        result = asyncio.run(sample())
    finally:
        engine.stop()
    assert result.lora_path == "policy-v2" and result.policy_version == 2
    final = fp32_model(out / "final")
    gaps = logprob_mismatch(final, prompt, result.output_ids, result.output_token_logprobs)
    base = logprob_mismatch(fp32_model(tiny_model_dir), prompt, result.output_ids, result.output_token_logprobs)
    record_figures("lora_adapter_publish", {"vs_final_max": gaps["max_abs_diff"], "vs_base_max": base["max_abs_diff"]})
    assert gaps["max_abs_diff"] < FP32_CUDA_ATOL, gaps
    assert base["max_abs_diff"] > FP32_CUDA_ATOL, "the engine served the base model, not the adapter"


def test_qlora_step(db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A 4-bit (NF4) base with bf16 LoRA adapters trains one step and saves an adapter checkpoint."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (the GPU kit carries a trimmed wheel)")
    from agentrl.train import main

    asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
    out = tmp_path / "out"
    assert main(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "1",
                             "--save_steps", "1", "--enable_sampling", "false", "--use_peft", "--load_in_4bit",
                             "--lora_target_modules", "all-linear")) == 0
    client = sync_client(db_uri)
    try:
        values = client.get_default_database().Metric.find_one({"step": 1})["values"]
    finally:
        client.close()
    record_figures("qlora", {"loss": values["loss"], "grad_norm": values["grad_norm"]})
    assert values["grad_norm"] > 0 and torch.isfinite(torch.tensor(values["loss"]))
    assert (out / "checkpoint-1").is_dir()


def test_the_bf16_head_on_cuda_equals_its_cpu_emulation() -> None:
    # torch.mm(..., out_dtype=torch.float32) in the matrix units against the same product from fp32 copies on the
    # CPU (test_trainer_precision checks the emulation's numbers and gradients): forward and both gradients.
    from agentrl.training.logprobs import head_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(2, 300, 256, dtype=torch.bfloat16)
    weight = torch.randn(5000, 256) / 16
    targets = torch.randint(0, 5000, (2, 300))
    results = []
    for device in ("cpu", "cuda"):
        h = hidden.to(device).requires_grad_()
        w = weight.to(device).requires_grad_()
        out = head_logprobs(h, w, None, targets.to(device), 0.8, chunk_bytes=4 * 5000 * 128,
                            matmul_dtype=torch.bfloat16)
        grads = torch.autograd.grad(out.sum(), (h, w))
        results.append([t.float().cpu() for t in (out, *grads)])
    for cpu, cuda in zip(*results, strict=True):
        assert torch.allclose(cpu, cuda, rtol=1e-2, atol=1e-3), float((cpu - cuda).abs().max())



def test_the_paged_decode_kernel_on_cuda_matches_sdpa_and_replays_in_a_graph() -> None:
    # Qwen3-0.6B's attention shape in bf16, keys 1 to 2,000 through a random block table; then the same call
    # captured once as a CUDA graph and replayed with other lengths and pages (what the engine's graphs do).
    from agentrl.inference.decode_kernel import paged_decode_attention, paged_decode_reference

    torch.manual_seed(0)
    page, pages, requests = 32, 512, 16
    k_cache = torch.randn(pages * page, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(pages * page, 8, 128, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(requests, 16, 128, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(pages, device="cuda")[:requests * 32].view(requests, 32).to(torch.int32)
    seq_lens = torch.randint(1, 1000, (requests,), device="cuda", dtype=torch.int32)
    seq_lens[0], seq_lens[1] = 1, 32
    out = paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, page, 128 ** -0.5)
    expected = paged_decode_reference(query, k_cache, v_cache, block_table, seq_lens, page, 128 ** -0.5)
    first = float((out.float() - expected.float()).abs().max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_decode_attention(query, k_cache, v_cache, block_table, seq_lens, page, 128 ** -0.5)
    seq_lens.copy_(torch.randint(1, 1024, (requests,), device="cuda", dtype=torch.int32))
    block_table.copy_(torch.randperm(pages, device="cuda")[:requests * 32].view(requests, 32))
    graph.replay()
    expected = paged_decode_reference(query, k_cache, v_cache, block_table, seq_lens, page, 128 ** -0.5)
    replayed = float((captured.float() - expected.float()).abs().max())
    record_figures("paged_decode_kernel", {"max_abs_diff": first, "replayed_max_abs_diff": replayed})
    assert first < 2e-2 and replayed < 2e-2


async def test_captured_decode_steps_match_eager_ones_and_follow_weight_updates(scripted_model_dir: Path) -> None:
    # The batcher on CUDA with and without decode graphs: the same greedy tokens, logprobs as an fp32 forward's;
    # a weight update copies into the parameters the graphs read (addresses unchanged), and the replayed steps then
    # follow the new weights.
    from transformers import AutoModelForCausalLM

    from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling

    ids = prompts(scripted_model_dir)
    outputs, captured = {}, []
    for graphs in (False, True):
        model = AutoModelForCausalLM.from_pretrained(scripted_model_dir, dtype=torch.float32,
                                                     attn_implementation="sdpa").to("cuda")
        batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=8192, decode_graphs=graphs))
        batcher.start()
        try:
            outputs[graphs] = await asyncio.gather(*[batcher.generate(
                p, max_new_tokens=24, stop_token_ids=[], sampling=RequestSampling(top_k=1)) for p in ids])
            if graphs:
                captured = batcher.graphs.captured
                graphs_before = {size: bucket.graph for size, bucket in batcher.graphs._buckets.items()}
                addresses = [p.data_ptr() for p in model.parameters()]
                other = fp32_model(scripted_model_dir)
                with torch.no_grad():
                    for parameter in other.parameters():
                        parameter.mul_(1.02)
                await asyncio.to_thread(batcher.load_state_dict, other.state_dict(), "v2")
                # the same batch again: the graph captured before the update replays with the new weights
                after = await asyncio.gather(*[batcher.generate(
                    p, max_new_tokens=24, stop_token_ids=[], sampling=RequestSampling(top_k=1)) for p in ids])
                assert [p.data_ptr() for p in model.parameters()] == addresses
                assert all(batcher.graphs._buckets[size].graph is graph  # replayed, not captured again
                           for size, graph in graphs_before.items())
        finally:
            batcher.stop()
    reference = fp32_model(scripted_model_dir)
    gaps = [logprob_mismatch(reference, p, o.generated_tokens, o.logprobs) for p, o in zip(ids, outputs[True])]
    updated = max(logprob_mismatch(other, p, o.generated_tokens, o.logprobs)["max_abs_diff"]
                  for p, o in zip(ids, after))
    record_figures("decode_graphs", {"captured": captured, "max_abs_diff": max(g["max_abs_diff"] for g in gaps),
                                     "after_update_max_abs_diff": updated})
    assert any(size >= len(ids) for size in captured), captured  # the step of all prompts ran as a graph
    assert [o.generated_tokens for o in outputs[True]] == [o.generated_tokens for o in outputs[False]]
    assert max(g["max_abs_diff"] for g in gaps) <= FP32_CUDA_ATOL and updated <= FP32_CUDA_ATOL
    assert all(o.versions == [("v2", 24)] for o in after)


def test_a_qwen2_5_vl_3b_shape_serves_trains_and_publishes_with_images(mongo_server_uri: str, tmp_path: Path) -> None:
    """A random-weight model of Qwen2.5-VL-3B's widths (``QWEN2_5_VL_3B_SHAPE``: 4 of its text layers and vision
    blocks): the bf16 engine answers prompts with a picture each, the trainer (one process, bf16 layers, fp32 head)
    rebuilds the pictures' pixels from GridFS and agrees with the engine within the bf16 bound before its update,
    takes one step and publishes in memory; the engine then serves the new version with pictures."""
    import io

    from PIL import Image

    from agentrl.inference.tiny_model import QWEN2_5_VL_3B_SHAPE, build_tiny_vision_model
    from agentrl.vision.images import load_image
    from agentrl.vision.processor import VisionProcessor

    model_dir = build_tiny_vision_model(tmp_path / "vlm", shape=QWEN2_5_VL_3B_SHAPE, max_pixels=448 * 448)
    processor = VisionProcessor(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pictures = []
    for seed in range(4):
        out = io.BytesIO()
        pixels = torch.randint(0, 255, (224 + 56 * seed, 280, 3), generator=torch.Generator().manual_seed(seed),
                               dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(out, "PNG")
        pictures.append(load_image(out.getvalue(), f"picture {seed}"))
    prompts_ids = []
    for picture in pictures:
        text = tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Describe the picture."}]}], add_generation_prompt=True,
            tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts_ids.append(processor.expand(ids, [processor.image_tokens(picture)]))
    name = "t_" + uuid.uuid4().hex[:12]
    uri = with_database(mongo_server_uri, name)
    engine = start_engine(model_dir, "--device", "cuda", "--dtype", "bfloat16", "--max_total_tokens", "32768")
    try:
        async def sample() -> list:
            async with SGLangClient(engine.url) as client:
                return await asyncio.gather(*[client.generate(
                    ids, {"temperature": 1.0, "max_new_tokens": 32, "sampling_seed": i, "ignore_eos": True},
                    image_data=[picture.data_uri()]) for i, (ids, picture) in enumerate(zip(prompts_ids, pictures))])

        samples = as_samples(prompts_ids, asyncio.run(sample()), [[picture.sha256] for picture in pictures])

        async def store() -> None:
            async with Store(uri) as db:
                for picture in pictures:
                    await db.images.put(picture)
            await enqueue(uri, samples, services=[engine.url])

        asyncio.run(store())
        done = run_trainer(trainer_args(uri, model_dir, tmp_path / "out", "--train_batch_size", str(len(samples)),
                                        "--enable_sampling", "false", "--max_steps", "1", "--save_steps", "0",
                                        dtype=None), timeout_s=300)
        assert done.returncode == 0, done.stdout[-4000:]

        async def served() -> object:
            async with SGLangClient(engine.url) as client:
                return await client.generate(prompts_ids[0], {"temperature": 0, "max_new_tokens": 4},
                                             image_data=[pictures[0].data_uri()])

        after = asyncio.run(served())
    finally:
        engine.stop()
    client = sync_client(uri)
    try:
        values = client[name].Metric.find_one({"step": 1})["values"]
        client.drop_database(name)
    finally:
        client.close()
    record_figures("qwen2_5_vl_3b_shape", {
        "logprob_mismatch_mean": values["logprob_mismatch_mean"], "logprob_mismatch_max": values[
            "logprob_mismatch_max"], "image_tokens": [processor.image_tokens(p) for p in pictures],
        "tokens_per_s": values["tokens_per_s"], "grad_norm": values["grad_norm"],
        "served_version_after": after.meta_info.get("weight_version")})
    assert values["logprob_mismatch_mean"] < BF16_MEAN_BOUND, values
    assert values["grad_norm"] > 0 and after.meta_info.get("weight_version") == "1", (values, after.meta_info)
