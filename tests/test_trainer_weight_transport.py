"""The trainer's in-memory publishing (``--weight_transport``) against a real ``agentrl engine`` and a stand-in for an
SGLang without the weight-update group (``--weight_transport distributed``): buckets of a few MiB broadcast over a
group per service, or shared in place with a service on this host (``tensor``), nothing written per step; a
service that cannot join gets the files; ``auto`` from a CPU trainer shares memory; a transfer that breaks on
either side mid-bucket leaves the engine serving its previous version, and the trainer falls back to disk for that
publish (engine side) or, killed, leaves nothing half-served (trainer side)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
import torch

from agentrl.failpoints import ENV, EXIT_CODE
from agentrl.inference import SGLangClient
from agentrl.store import sync_client
from inference_fixtures import start_engine
from sglang_standin import StandInProcess
from trainer_fixtures import enqueue, make_samples, run_trainer, trainer_args

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198]
IN_MEMORY = ("--weight_transport", "distributed", "--weight_bucket_mb", "1")  # the tiny model (~13 MiB) in buckets


def _served(url: str) -> tuple[str, list[float]]:
    async def ask() -> tuple[str, list[float]]:
        async with SGLangClient(url) as client:
            result = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        return result.weight_version, result.output_token_logprobs

    return asyncio.run(ask())


def _logprobs_of(model_dir: Path, url: str) -> list[float]:
    """What the engine at ``url`` answers once it loaded ``model_dir`` from disk (the disk path, same engine)."""
    async def load() -> None:
        async with SGLangClient(url) as client:
            await client.update_weights_from_disk(str(model_dir), weight_version="disk")

    asyncio.run(load())
    version, logprobs = _served(url)
    assert version == "disk"
    return logprobs


def _metrics(db_uri: str) -> dict[int, dict[str, float]]:
    client = sync_client(db_uri)
    try:
        return {d["step"]: d["values"] for d in client.get_default_database().Metric.find()}
    finally:
        client.close()


def _run(db_uri: str) -> dict:
    client = sync_client(db_uri)
    try:
        return client.get_default_database().Run.find_one()
    finally:
        client.close()


@pytest.mark.parametrize(("transport", "refusal"), [
    ("distributed", "cannot join a weight-update group"),  # the stand-in has no /init_weights_update_group
    ("tensor", "has no /update_weights_from_tensor"),  # nor /update_weights_from_tensor (404)
])
def test_in_memory_publishing_reaches_engines_and_the_files_reach_an_sglang_without_the_endpoint(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path, transport: str, refusal: str) -> None:
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    try:
        with StandInProcess(reply_ids=[5, 6, 2]) as standin:
            asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2), services=[standin.url]))
            out = tmp_path / "out"
            result = run_trainer(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps",
                                              "2", "--save_steps", "0", "--max_staleness", "none",
                                              "--policy_probe_max_diff", "0", "--weight_transport", transport,
                                              "--weight_bucket_mb", "1"), timeout_s=120)
            assert result.returncode == 0, result.stdout
            loads = standin.requests("/update_weights_from_disk")
        version, logprobs = _served(engine.url)
        from_disk = _logprobs_of(out / "weights" / "2", engine.url)
    finally:
        engine.stop()
    # the stand-in gets the files, said once
    assert result.stdout.count(f"inference service {standin.url} {refusal}") == 1
    assert "published weights version 2 to 2 of 2 inference services (1 in memory, 1 from" in result.stdout
    assert [r["body"]["weight_version"] for r in loads] == ["1", "2"]
    assert [Path(r["body"]["model_path"]).name for r in loads] == ["1", "2"]
    assert version == "2" and _metrics(db_uri)[2]["publish_failures"] == 0
    assert logprobs == from_disk  # bit-identical to the same weights loaded from disk


def test_auto_on_a_cpu_trainer_shares_memory_with_an_engine_on_its_host(db_uri: str, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    """``--weight_transport auto`` (the default) from a CPU trainer: shared memory with the engines on its host (on
    one CPU host faster than the page cache: measured in the main job); nothing is written per step; the log says
    how the weights travel."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=1)))
        out = tmp_path / "out"
        result = run_trainer(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "1",
                                          "--save_steps", "0"), timeout_s=120)
        assert result.returncode == 0, result.stdout
        version, _ = _served(engine.url)
    finally:
        engine.stop()
    assert "weights reach the inference services in memory, shared with the services on this host" in result.stdout
    assert "published weights version 1 to 1 of 1 inference services (1 in memory)" in result.stdout
    assert version == "1" and not (out / "weights" / "1").exists()


def test_a_service_that_never_answers_a_shared_bucket_gets_the_version_from_disk(tmp_path: Path) -> None:
    """A peer on this host that accepts the connection and never answers: the send ends at
    ``--weight_update_timeout_s`` (1 s here) with an error naming the wait, not never."""
    from agentrl.training import weight_transport
    from agentrl.training.aio import LoopThread

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        io = LoopThread("test-io")
        sender = weight_transport.TensorSender(io, timeout_s=1)
        try:
            assert io.run(sender.join(url)) is None
            started = time.monotonic()
            result = sender.send(iter([[("a", torch.ones(4))], [("b", torch.ones(2))]]), [url], 3)
            waited = time.monotonic() - started
        finally:
            sender.close()
            io.close()
    assert result.failures[url] == "the service did not answer within 1 s" and not result.last
    assert waited < 10


def test_a_full_shared_memory_sends_the_version_through_disk(tmp_path: Path, monkeypatch) -> None:
    """A container's small ``/dev/shm`` (Docker's default is 64 MiB) cannot hold a bucket: the services get the
    version through disk and the log says why. The allocation failure is simulated (a test cannot shrink this
    machine's ``/dev/shm``); the error is torch's own message for it."""
    from agentrl.inference import tensor_payload
    from agentrl.training import weight_transport
    from agentrl.training.aio import LoopThread

    def full(buffer: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("unable to write to file </torch_1_2_3>: No space left on device (28)")

    monkeypatch.setattr(tensor_payload, "share_for_sending", full)
    io = LoopThread("test-io")
    sender = weight_transport.TensorSender(io, timeout_s=10)
    try:
        assert io.run(sender.join("http://127.0.0.1:1")) is None
        buckets = [[("a", torch.ones(4))], [("b", torch.ones(2))]]
        taken = []
        result = sender.send((taken.append(b) or b for b in buckets), ["http://127.0.0.1:1"], 3)
    finally:
        sender.close()
        io.close()
    assert len(taken) == 2  # every bucket taken (the other ranks' gathers go on)
    assert "No space left on device" in result.failures["http://127.0.0.1:1"] and not result.last
    assert "/dev/shm may be too small" in result.failures["http://127.0.0.1:1"]


def test_an_engine_failing_mid_transfer_keeps_its_weights_and_gets_the_version_from_disk(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The engine's first bucket fails after it arrived: it discards what it staged and keeps serving; the trainer
    says so and the engine loads the version from disk; the next publish goes in memory again."""
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1",
                          env={ENV: "engine.weight_update.after_receive"})
    try:
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
        out = tmp_path / "out"
        result = run_trainer(trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                                          "--save_steps", "0", "--max_staleness", "none", *IN_MEMORY))
        assert result.returncode == 0, result.stdout
        version, logprobs = _served(engine.url)
        from_disk = _logprobs_of(out / "final", engine.url)
    finally:
        engine.stop()
    assert "the in-memory transfer to inference service" in result.stdout and "loads this version from disk" \
        in result.stdout, result.stdout
    assert "published weights version 1 to 1 of 1 inference services (0 in memory, 1 from" in result.stdout
    assert "published weights version 2 to 1 of 1 inference services (1 in memory)" in result.stdout
    metrics = _metrics(db_uri)
    assert [metrics[s]["publish_failures"] for s in (1, 2)] == [0.0, 0.0]
    assert [metrics[s]["policy_probe_max_mean_abs_diff"] <= 1e-5 for s in (1, 2)] == [True, True], metrics
    assert version == "2" and logprobs == from_disk


def test_a_trainer_killed_mid_transfer_leaves_the_engine_serving_its_previous_weights(
        db_uri: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(tiny_model_dir, "--db_connection_string", db_uri, "--heartbeat_interval_s", "1")
    try:
        before = _served(engine.url)
        asyncio.run(enqueue(db_uri, make_samples(tiny_model_dir, groups=2)))
        out = tmp_path / "out"
        flags = trainer_args(db_uri, tiny_model_dir, out, "--train_batch_size", "4", "--max_steps", "2",
                             "--save_steps", "0", "--max_staleness", "none", *IN_MEMORY)
        killed = run_trainer(flags, env={ENV: "publish.distributed.after_first_bucket=exit"})
        assert killed.returncode == EXIT_CODE, killed.stdout
        assert _served(engine.url) == before  # one bucket staged, nothing swapped in
        assert _run(db_uri)["policy_version"] == 0
        finished = run_trainer(flags)  # a fresh trainer: its group is new, the old one's staging is dropped
        assert finished.returncode == 0, finished.stdout
        version, logprobs = _served(engine.url)
        from_disk = _logprobs_of(out / "final", engine.url)
    finally:
        engine.stop()
    assert version == "2" and logprobs == from_disk
    assert torch.tensor(logprobs).ne(torch.tensor(before[1])).any()
