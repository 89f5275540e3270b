"""Tasks with images through a real ``agentrl sample``, ``agentrl engine`` and trainer on a tiny Qwen2.5-VL: each
call sends the Task's pictures, stores their sha256 and the ids with their ``<|image_pad|>`` runs expanded, a
trajectory's turns extend each other token for token, and the queued samples name their images; the engine's
logprobs of the sampled tokens are those of transformers' model on the stored ids and the images read back from
GridFS; the trainer rebuilds the pixels, agrees with the engine to the text bound before its first update, trains
and publishes to the engine, which then serves the new weights with images."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from agentrl.inference.process import EngineProcess
from agentrl.inference.tiny_model import build_tiny_vision_model
from agentrl.store import Store
from agentrl.vision.processor import VisionProcessor
from inference_fixtures import picture, start_engine
from rollout_fixtures import agentrl_cmd, documents, run_env, upload
from test_rollout_sampler import full_prompts, run_sampler
from trainer_fixtures import trainer_args

pytestmark = pytest.mark.xdist_group("vision-rollout")


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp("vlm"), family="qwen2_5_vl")


@pytest.mark.parametrize(("transport", "lora"), [("auto", False), ("disk", False), ("auto", True)])
def test_tasks_with_images_roll_out_token_exact_and_train(db_uri: str, tmp_path: Path, vision_model: Path,
                                                          vision_engine: str, transport: str, lora: bool) -> None:
    pictures = {"a.png": picture(1, (60, 90)), "b.png": picture(2, (112, 56)), "c.png": picture(3, (84, 84))}
    for name, data in pictures.items():
        (tmp_path / name).write_bytes(data)
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in pictures.items()}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(row) for row in [
        {"id": "one", "question": "What colour dominates?", "answer": "red", "images": ["a.png"]},
        {"id": "two", "question": "Which is larger?", "answer": "left", "images": ["b.png", "c.png"]},
    ]) + "\n")
    upload(db_uri, tasks, "--num_generations", "2")
    run_sampler(agentrl_cmd(
        "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(vision_model),
        "--inference_urls", vision_engine, "--max_turns", "2", "--max_new_tokens", "6", "--temperature", "1",
        "--seed", "0",
        "--zero_variance_threshold", "0", "--drop_zero_advantage", "false", "--exit_when_done", "true"))

    records = documents(db_uri, "Record")
    assert len(records) == 4 and not [r for r in records if r["status"] == "failed"], records
    calls = documents(db_uri, "DispatchedSamplingTask")
    processor = VisionProcessor(vision_model)
    by_record: dict[str, list[dict]] = {}
    for call in calls:
        by_record.setdefault(call["record_id"], []).append(call)
    for record in records:
        own = sorted(by_record[record["_id"]], key=lambda c: c["turn"])
        want = [sha["a.png"]] if record["task_id"].endswith(":one") else [sha["b.png"], sha["c.png"]]
        assert len(own) == 2 and all(call["images"] == want for call in own)
        prompts = full_prompts(own)
        first = prompts[own[0]["_id"]]
        runs = [len(run) for run in "".join("x" if t == processor.image_token_id else " " for t in first).split()]
        assert runs == [processor.image_tokens(_load(pictures, sha, s)) for s in want]
        assert prompts[own[1]["_id"]][:len(first)] == first  # the second turn extends the first
    samples = documents(db_uri, "DBRecordData")
    assert samples and all(s["images"] == next(c["images"] for c in calls if c["record_id"] == s["record_id"])
                           for s in samples)

    # The engine's logprobs of what it sampled = transformers' model on the stored ids and the stored images.
    model = AutoModelForImageTextToText.from_pretrained(vision_model, attn_implementation="sdpa").eval()
    worst = 0.0
    for sample in samples:
        images = asyncio.run(_read_images(db_uri, sample["images"]))
        inputs = processor.inputs(images)
        ids = torch.tensor([sample["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                           mm_token_type_ids=(ids == processor.image_token_id).int()).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(sample["loss_mask"][1:], dtype=torch.bool)
        engine = torch.tensor(sample["logprobs"][1:])
        assert int(mask.sum()) > 0
        worst = max(worst, float((logprobs[mask] - engine[mask]).abs().max()))
    assert worst < 1e-4, worst

    # The trainer: pixels rebuilt from GridFS, engine-vs-trainer logprobs within the text bound before its first
    # update, then trained, published to the engine (from disk) and served with images. The tiny model answers
    # nothing, so every reward is 0: the test gives the queued samples advantages of +-1 to have a gradient.
    from pymongo import MongoClient

    from agentrl.train import main

    client = MongoClient(db_uri)
    for i, sample in enumerate(samples):
        sign = 1.0 if i % 2 == 0 else -1.0
        client.get_default_database().DBRecordData.update_one({"_id": sample["_id"]}, {"$set": {
            "advantages": [sign * m for m in sample["loss_mask"]]}})
    client.close()
    half = str(-(-len(samples) // 2))  # two steps (a trajectory may have branched: more samples than records)
    assert main(trainer_args(db_uri, vision_model, tmp_path / "out", "--train_batch_size", half,
                             "--max_steps", "2", "--max_staleness", "none", "--weight_transport", transport,
                             *(("--use_peft", "--lora_target_modules", "q_proj", "v_proj") if lora else ()))) == 0
    metrics = {doc["step"]: doc["values"] for doc in documents(db_uri, "Metric", {"split": "train"})}
    assert sorted(metrics) == [1, 2]
    assert metrics[1]["logprob_mismatch_max"] < 1e-4, metrics[1]
    assert metrics[1]["grad_norm"] > 0 and metrics[2]["logprob_mismatch_max"] > 1e-3  # the weights moved
    assert {d["status"] for d in documents(db_uri, "DBRecordData")} == {"trained"}
    assert (tmp_path / "out" / "final" / "preprocessor_config.json").is_file()  # a complete vision model
    image = pictures["a.png"]
    import base64

    import httpx

    ids = next(c for c in calls if c["turn"] == 0 and c["images"] == [sha["a.png"]])["input_ids"]
    reply = httpx.post(f"{vision_engine}/generate", timeout=60, json={
        "input_ids": ids, "image_data": ["data:image/png;base64," + base64.b64encode(image).decode()],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert reply["meta_info"]["weight_version"] == "2", reply
    httpx.post(f"{vision_engine}/update_weights_from_disk", timeout=60, json={  # the next test starts afresh
        "model_path": str(vision_model), "weight_version": "0"}).raise_for_status()


def test_evaluations_show_the_model_each_tasks_pictures(db_uri: str, tmp_path: Path, vision_model: Path,
                                                         vision_engine: str) -> None:
    """`agentrl eval` of a task file and of a stored split: the evaluation's copies of the Tasks keep their pictures
    (stored in GridFS first) and every call sends them (an evaluation that dropped them scored a blind model)."""
    pictures = {"a.png": picture(4, (56, 56)), "b.png": picture(5, (84, 56))}
    for name, data in pictures.items():
        (tmp_path / name).write_bytes(data)
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in pictures.items()}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "one", "question": "What colour?", "answer": "red", "images": ["a.png"]})
                     + "\n" + json.dumps({"id": "two", "question": "Which?", "answer": "left",
                                          "images": ["b.png", "a.png"]}) + "\n")
    common = ["--db_connection_string", db_uri, "--inference_urls", vision_engine, "--model_name_or_path",
              str(vision_model), "--mcp_config", "none", "--scorer", "exact", "--max_turns", "1",
              "--max_new_tokens", "4", "--json"]

    def evaluate(*args: str) -> dict:
        done = subprocess.run(agentrl_cmd("eval", *common, *args), capture_output=True, text=True, env=run_env(),
                              timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    want = {"one": [sha["a.png"]], "two": [sha["b.png"], sha["a.png"]]}
    from_file = evaluate("--tasks", str(tasks))
    stored = asyncio.run(_read_images(db_uri, list(sha.values())))  # stored by the evaluation itself
    assert [image.data for image in stored] == [pictures["a.png"], pictures["b.png"]]
    upload(db_uri, tasks, "--split", "heldout")
    from_split = evaluate("--split", "heldout")
    for result in (from_file, from_split):
        copies = documents(db_uri, "Task", {"split": result["split"]})
        assert {t["_id"].rsplit(":", 1)[1]: t["images"] for t in copies} == want
        calls = documents(db_uri, "DispatchedSamplingTask", {"task_id": {"$in": [t["_id"] for t in copies]}})
        assert len(calls) == 2 and all(c["images"] == want[c["task_id"].rsplit(":", 1)[1]] for c in calls)
        assert result["metrics"]["errors"] == 0


def test_a_generated_picture_placeholder_ends_the_trajectory_untrained(db_uri: str, tmp_path: Path) -> None:
    """A policy that writes ``<|image_pad|>``: no picture stands behind it, so no trainer could forward its ids (before
    this guard, every turn re-rendered its prompt without them and each call's sample — the placeholders in its
    output — was queued for the trainer). The trajectory ends ``vision_token_error`` at its first such reply, the
    call says why, the group stage drops it (nothing queued) and the sampler finishes the Task."""
    from scripted_vision_model import build_placeholder_vision_model

    image, query = picture(6, (56, 56)), "What colour dominates?"
    model = build_placeholder_vision_model(tmp_path / "model", image, query)
    (tmp_path / "a.png").write_bytes(image)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "one", "question": query, "answer": "red", "images": ["a.png"]}) + "\n")
    upload(db_uri, tasks, "--num_generations", "2")
    engine = start_engine(model)
    try:
        run_sampler(agentrl_cmd(
            "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(model),
            "--inference_urls", engine.url, "--max_turns", "3", "--max_new_tokens", "4", "--temperature", "0",
            "--zero_variance_threshold", "0", "--drop_zero_advantage", "false", "--exit_when_done", "true"))
    finally:
        engine.stop()
    processor = VisionProcessor(model)
    records = documents(db_uri, "Record")
    assert len(records) == 2 and {r["outcome"] for r in records} == {"vision_token_error"}, records
    assert {r["failure_class"] for r in records} == {"vision_token"}
    assert all(r["num_turns"] == 1 and "placeholder" in r["error"] for r in records)
    calls = documents(db_uri, "DispatchedSamplingTask")
    assert len(calls) == 2 and all(c["status"] == "formaterror" and c["output_ids"][0] == processor.image_token_id
                                   for c in calls), calls
    assert documents(db_uri, "DBRecordData") == []
    [task] = documents(db_uri, "Task")
    assert task["status"] == "completed"


def _load(pictures: dict[str, bytes], sha: dict[str, str], wanted: str):
    from agentrl.vision.images import load_image

    name = next(name for name, value in sha.items() if value == wanted)
    return load_image(pictures[name], name)


async def _read_images(db_uri: str, ids: list[str]) -> list:
    async with Store(db_uri) as store:
        found = await store.images.get_many(ids)
    return [found[sha] for sha in ids]


def test_an_mcp_tool_returns_a_picture_the_model_sees(db_uri: str, tmp_path: Path, scripted_vision_model_dir: Path,
                                                      everything_server_entry: Path, launch_engine) -> None:
    """The scripted Qwen2.5-VL calls ``get-tiny-image`` of the MCP project's reference server (npm): the result's
    PNG (the server's logo, whose broken colour-profile checksum is dropped as browsers drop it) is stored once in
    GridFS, named on the tool result, shown after the result's text in the next prompt, its tokens expanded; the
    model answers, and the group's scores vary."""
    from agentrl.vision.images import load_image
    from scripted_vision_model import ANSWER, QUESTION, everything_config, task_picture

    (tmp_path / "task.png").write_bytes(task_picture())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "match", "question": QUESTION, "answer": ANSWER, "images": ["task.png"]}))
    upload(db_uri, tasks, "--num_generations", "4")
    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"servers": [s.model_dump(exclude_none=True)
                                           for s in everything_config(everything_server_entry).servers]}))
    engine: EngineProcess = launch_engine(scripted_vision_model_dir)
    try:
        run_sampler(agentrl_cmd(
            "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(scripted_vision_model_dir),
            "--inference_urls", engine.url, "--mcp_config", str(mcp), "--max_turns", "3", "--max_new_tokens", "40",
            "--temperature", "1", "--seed", "3", "--exit_when_done", "true"))
        from agentrl.train import main  # one step on the group: the tool's picture trained on and published

        assert main(trainer_args(db_uri, scripted_vision_model_dir, tmp_path / "out", "--train_batch_size", "4",
                                 "--max_steps", "1")) == 0
    finally:
        engine.stop()
    (metrics,) = [doc["values"] for doc in documents(db_uri, "Metric", {"split": "train"})]
    assert metrics["logprob_mismatch_max"] < 1e-4 and metrics["grad_norm"] > 0, metrics
    records = documents(db_uri, "Record")
    assert len(records) == 4 and {r["outcome"] for r in records} == {"answer"}, records
    calls = documents(db_uri, "DispatchedSamplingTask")
    first = [c for c in calls if c["turn"] == 0]
    second = [c for c in calls if c["turn"] == 1]
    task_sha = hashlib.sha256(task_picture()).hexdigest()
    logos = {result["images"][0] for call in first for result in call["tool_results"]}
    assert len(logos) == 1 and all(c["tool_results"][0]["status"] == "ok" for c in first)
    logo = logos.pop()
    assert [c["images"] for c in first] == [[task_sha]] * 4 and [c["images"] for c in second] == [[task_sha, logo]] * 4
    stored = asyncio.run(_read_images(db_uri, [logo]))[0]
    assert (stored.format, stored.width, stored.height) == ("PNG", 20, 20)
    processor = VisionProcessor(scripted_vision_model_dir)
    for call in second:
        delta = call["prompt_delta_ids"]
        assert "<|im_start|>tool" in call["prompt_delta_text"] and "<|image_pad|>" in call["prompt_delta_text"]
        assert delta.count(processor.image_token_id) == processor.image_tokens(load_image(stored.data, "logo"))
    assert len({r["score"] for r in records}) == 2  # both endings were sampled: a group with signal
    samples = documents(db_uri, "DBRecordData")
    assert samples and all(s["images"] == [task_sha, logo] for s in samples)
    export = _audit(db_uri, tmp_path, task_sha, logo, stored.data)
    _sft_on_the_export(db_uri, export, scripted_vision_model_dir, tmp_path / "sft-out", task_sha, logo)


def _audit(db_uri: str, tmp_path: Path, task_sha: str, logo: str, logo_bytes: bytes) -> Path:
    """The run's pictures in ``agentrl dashboard`` (conversation, token view, the image route) and in ``agentrl
    export`` (files beside the JSONL, referenced from the messages)."""
    import httpx
    from pymongo.uri_parser import parse_uri

    from test_dashboard import start_dashboard, stop

    run = parse_uri(db_uri)["database"]
    process, url = start_dashboard(f"agentrl dashboard --db_connection_string '{db_uri}' --port 0")
    try:
        record = documents(db_uri, "Record")[0]["_id"]
        page = httpx.get(f"{url}runs/{run}/records/{record}", timeout=30).text
        assert f'<img src="/api/runs/{run}/images/{task_sha}"' in page and f"/api/runs/{run}/images/{logo}" in page
        assert '"image_runs": [{"end": ' in page  # the token view shows each picture where its tokens start
        image = httpx.get(f"{url}api/runs/{run}/images/{logo}", timeout=30)
        assert image.status_code == 200 and image.content == logo_bytes
        assert image.headers["content-type"] == "image/png" and image.headers["x-content-type-options"] == "nosniff"
        for bad in ("0" * 64, "../../etc/passwd", logo.upper()):
            assert httpx.get(f"{url}api/runs/{run}/images/{bad}", timeout=30).status_code == 404
    finally:
        stop(process)
    out = tmp_path / "export" / "records.jsonl"
    out.parent.mkdir()
    done = subprocess.run(agentrl_cmd("export", "--db_connection_string", db_uri, "--out", str(out)),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 0 and "and 2 images to" in done.stdout, done.stdout + done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    paths = {f"records.jsonl.images/{task_sha}.png", f"records.jsonl.images/{logo}.png"}
    assert all(set(row["images"]) == paths for row in rows)
    assert (out.parent / f"records.jsonl.images/{logo}.png").read_bytes() == logo_bytes
    user = next(m for m in rows[0]["messages"] if m["role"] == "user")
    assert user["content"][0] == {"type": "image_url", "image_url": {"url": f"records.jsonl.images/{task_sha}.png"}}
    tool = next(m for m in rows[0]["messages"] if m["role"] == "tool")
    assert tool["content"][-1]["image_url"]["url"] == f"records.jsonl.images/{logo}.png"
    return out


def _sft_on_the_export(db_uri: str, export: Path, model: Path, out: Path, task_sha: str, logo: str) -> None:
    """The export back in as SFT data (``agentrl sft upload``: image_url parts read from the files beside it), and
    one cross-entropy step on it with the pictures."""
    from agentrl.train import main

    done = subprocess.run(agentrl_cmd("sft", "upload", str(export), "--db_connection_string", db_uri, "--split", "sft",
                                      "--model_name_or_path", str(model)),
                          capture_output=True, text=True, env=run_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    samples = documents(db_uri, "DBRecordData", {"split": "sft"})
    processor = VisionProcessor(model)
    assert samples and all(s["images"] == [task_sha, logo] for s in samples)
    runs = [len(run) for run in "".join("x" if t == processor.image_token_id else " "
                                        for t in samples[0]["input_ids"]).split()]
    assert len(runs) == 2
    assert main(trainer_args(db_uri, model, out, "--split", "sft", "--enable_sampling", "false",
                             "--loss_calculater", "CrossEntropy", "--train_batch_size", "2", "--max_steps", "1")) == 0
    assert {s["status"] for s in documents(db_uri, "DBRecordData", {"split": "sft"})} >= {"trained"}


def test_babyai_observations_are_pictures_a_vision_policy_sees(db_uri: str, tmp_path: Path,
                                                                babyai_vision_model_dir: Path, launch_engine) -> None:
    """``agentrl envs serve babyai --images`` draws the agent's view beside every observation (an ``image`` field
    AgentGym's clients ignore; without the flag there is none); a vision-language policy's episode shows each
    picture before its observation's text, stored once each, its tokens expanded, every call naming the pictures
    of its prompt in order."""
    from agentrl.envs.client import AgentGymClient
    from agentrl.envs.local import start_local_server

    plain_url, stop_plain = start_local_server("babyai")
    url, stop = start_local_server("babyai", images=True)
    try:
        async def probe() -> tuple:
            drawn, plain = AgentGymClient("babyai", url), AgentGymClient("babyai", plain_url)
            try:
                instance = await drawn.create()
                _, _, first = await drawn.reset_seen(instance, 0)
                step = await drawn.step(instance, "turn left")
                other = await plain.create()
                return first, step.info.get("image"), (await plain.reset_seen(other, 0))[2]
            finally:
                await drawn.aclose()
                await plain.aclose()

        first, stepped, none = asyncio.run(probe())
        assert (first.format, first.width, first.height) == ("PNG", 56, 56) and stepped and none is None
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"id": f"babyai-{i}", "query": f"babyai task {i}", "scorer": "env_reward",
                                             "env": {"name": "babyai", "data_idx": i}}) + "\n" for i in (0, 1)))
        upload(db_uri, tasks, "--num_generations", "2", "--scorer", "env_reward")
        engine: EngineProcess = launch_engine(babyai_vision_model_dir)
        try:
            run_sampler(agentrl_cmd(
                "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(babyai_vision_model_dir),
                "--inference_urls", engine.url, "--env_server", f"babyai={url}", "--max_turns", "3",
                "--max_new_tokens", "8", "--temperature", "0", "--exit_when_done", "true"))
        finally:
            engine.stop()
    finally:
        stop()
        stop_plain()
    records = documents(db_uri, "Record")
    assert len(records) == 4 and not [r for r in records if r["status"] == "failed"], records
    processor = VisionProcessor(babyai_vision_model_dir)
    stored = {doc["_id"] for doc in documents(db_uri, "images.files")}
    for record in records:
        calls = sorted((c for c in documents(db_uri, "DispatchedSamplingTask") if c["record_id"] == record["_id"]),
                       key=lambda c: c["turn"])
        assert [c["env_step"]["action"] for c in calls] == ["turn left"] * 3
        assert [len(c["images"]) for c in calls] == [1, 2, 3]  # a picture per observation
        for previous, call in zip(calls, calls[1:]):
            assert call["images"][:len(previous["images"])] == previous["images"]
        assert set(calls[-1]["images"]) <= stored
        prompt = full_prompts(calls)[calls[-1]["_id"]]
        assert prompt.count(processor.image_token_id) == len(calls[-1]["images"]) * processor.image_tokens(first)
