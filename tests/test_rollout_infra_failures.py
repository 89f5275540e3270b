"""Infrastructure failures are not rewards: a sampler with no live inference service, and an LLM judge that is down,
give the attempt back unscored (no failed attempt counted) instead of settling the slot with a score of 0 or a
judge error; once the service or the judge is back, the Task completes normally.

Real pieces: the session's database server, the SGLang stand-in (``tests/sglang_standin.py``, a real HTTP server
process) as the inference service, an OpenAI-compatible judge served by uvicorn in a thread of this process (started
late, on a port fixed in advance), the real ``agentrl sample`` command. The first test runs the sampler in this
process, because ``agentrl sample`` has no flag for the pool's wait for a service (120 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from transformers import AutoTokenizer

from agentrl.rollout.agent import AgentResources
from agentrl.rollout.config import ConcurrencyConfig, RolloutConfig, SamplerConfig
from agentrl.rollout.inference_pool import InferencePool
from agentrl.rollout.sampler import Sampler
from agentrl.rollout.tool_parsers import get_parser
from agentrl.store import Store
from rollout_fixtures import agentrl_cmd, documents, run_env, upload
from sglang_standin import StandInProcess
from tools_fixtures import free_port

pytestmark = pytest.mark.slow

REPLY = "The product is \\boxed{42}."
FINISHED = {"ready", "abandoned"}


@pytest.fixture
def standin(tiny_model_dir: Path) -> Iterator[StandInProcess]:
    """An inference service whose every reply is ``REPLY``: the right answer to every task below."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with StandInProcess(tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id], REPLY) as server:
        yield server


def write_tasks(path: Path, count: int = 1) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": "What is 6 * 7?", "answer": "42"}) + "\n"
                            for i in range(count)))
    return path


def wait_for(predicate: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.1)
    return value


async def test_no_live_service_gives_the_slot_back_unscored_and_the_task_completes_later(
        db_uri: str, tmp_path: Path, tiny_model_dir: Path, standin: StandInProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agentrl.rollout")
    upload(db_uri, write_tasks(tmp_path / "tasks.jsonl"), "--num_generations", "2")
    config = SamplerConfig(db_connection_string=db_uri, model_name_or_path=str(tiny_model_dir),
                           rollout=RolloutConfig(max_turns=2, max_new_tokens=32),
                           concurrency=ConcurrencyConfig(max_concurrent_samples_per_process=2), exit_when_done=True)
    async with Store(db_uri, lease_s=config.concurrency.lease_s) as store:
        pool = InferencePool(store, wait_for_service_s=0.5)
        resources = AgentResources(store=store, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                                   inference=pool, parser=get_parser(config.rollout.tool_call_parser), config=config)
        sampler = Sampler(resources, owner=pool.owner)
        run = asyncio.create_task(sampler.run())
        try:
            async def both_given_up() -> bool:
                records = documents(db_uri, "Record")
                return len(records) == 2 and all(r["released"] or r["status"] != "running" for r in records)

            deadline = time.monotonic() + 60
            while not await both_given_up():
                assert time.monotonic() < deadline and not run.done(), documents(db_uri, "Record")
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the sampler is paused: it claims nothing meanwhile
            records = documents(db_uri, "Record")
            assert len(records) == 2, records
            for record in records:  # given back unscored: no failed_error, no score, no failed attempt
                assert record["released"] and record["status"] == "failed" and record["leased"], record
                assert record["failure_class"] == "inference_unavailable", record
                assert record.get("outcome") is None and record.get("score") is None, record
                assert "NoInferenceService" in record["error"], record
            calls = documents(db_uri, "DispatchedSamplingTask")
            assert calls and all(c["status"] == "failed" and "no live inference service" in c["error"]
                                 for c in calls)
            assert [t["status"] for t in documents(db_uri, "Task")] == ["running"]
            assert caplog.text.count("back unscored, to be retried; pausing until an inference service is live") == 2
            assert "no live inference service answers: sampler" in caplog.text

            await store.services.register(standin.url, kind="sglang")  # a service comes up: the sampler resumes
            stats = await asyncio.wait_for(run, 120)
        finally:
            sampler.stop()
            await asyncio.gather(run, return_exceptions=True)
            await pool.close()
    assert stats.scored == 2 and stats.score_errors == 0
    records = documents(db_uri, "Record")
    done = [r for r in records if r["status"] in FINISHED]
    assert len(done) == 2 and all((r["attempt"], r["failures"], r["score"]) == (2, 0, 1.0) for r in done), records
    retired = [r for r in records if r["attempt"] == 1]
    assert all(r["status"] == "failed" and r.get("outcome") is None and r.get("score") is None for r in retired)
    assert [t["status"] for t in documents(db_uri, "Task")] == ["completed"]


def judge_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> dict[str, Any]:
        prompt = (await request.json())["messages"][-1]["content"]
        reference = prompt.split("Reference answer: ")[1].splitlines()[0].strip()
        candidate = prompt.split("Candidate answer: ")[1].splitlines()[0].strip()
        return {"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()), "model": "judge",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": "Correct" if reference == candidate else "Incorrect"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@contextmanager
def judge_on(port: int) -> Iterator[None]:
    server = uvicorn.Server(uvicorn.Config(judge_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 30, "judge start")
    assert server.started, "the judge did not start"
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def start_sampler(db_uri: str, tmp_path: Path, tiny_model_dir: Path, standin: StandInProcess, judge_port: int,
                  *flags: str, **judge_settings: Any) -> tuple[subprocess.Popen, Path]:
    agent_config = tmp_path / "agent.yml"
    agent_config.write_text(json.dumps({"scorer_agent": {
        "models": [{"base_url": f"http://127.0.0.1:{judge_port}/v1", "model": "judge"}],
        "max_retries": 1, "retry_delay": 0, "timeout": 5, **judge_settings}}))  # JSON is YAML
    upload(db_uri, write_tasks(tmp_path / "tasks.jsonl"), "--num_generations", "2", "--scorer", "agentcpm")
    log = tmp_path / "sampler.log"
    with log.open("w") as out:
        sampler = subprocess.Popen(agentrl_cmd(
            "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(tiny_model_dir),
            "--inference_urls", standin.url, "--agent_config_path", str(agent_config), "--max_turns", "2",
            "--max_new_tokens", "32", "--max_concurrent_samples_per_process", "2", "--exit_when_done", "true", *flags),
            stdout=out, stderr=subprocess.STDOUT, env=run_env())
    return sampler, log


def kill(sampler: subprocess.Popen) -> None:
    if sampler.poll() is None:
        sampler.kill()
        sampler.wait(30)


def test_a_judge_that_comes_back_scores_the_trajectories_it_missed(db_uri: str, tmp_path: Path,
                                                                   tiny_model_dir: Path,
                                                                   standin: StandInProcess) -> None:
    port = free_port()  # nothing listens here until the judge starts
    sampler, log = start_sampler(db_uri, tmp_path, tiny_model_dir, standin, port)
    try:
        wait_for(lambda: "scorer 'agentcpm' unavailable; retrying" in log.read_text(), 120, "a judge retry")
        time.sleep(1.0)
        with judge_on(port):
            assert sampler.wait(120) == 0, log.read_text()
    finally:
        kill(sampler)
    records = documents(db_uri, "Record")
    assert len(records) == 2 and all(r["attempt"] == 1 for r in records), records  # retried while holding it
    for record in records:
        assert record["status"] in FINISHED and record.get("score_error") is None, record
        assert record["score"] == 1.0 and record["score_details"] == {"judge_model": "judge",
                                                                      "judge_reply": "Correct"}, record
    assert [t["status"] for t in documents(db_uri, "Task")] == ["completed"]


def test_a_judge_down_past_its_bound_gives_the_slot_back_not_failed(db_uri: str, tmp_path: Path,
                                                                     tiny_model_dir: Path,
                                                                     standin: StandInProcess) -> None:
    port = free_port()
    sampler, log = start_sampler(db_uri, tmp_path, tiny_model_dir, standin, port, unavailable_retry_s=1)
    try:
        wait_for(lambda: any(r["released"] for r in documents(db_uri, "Record")), 120, "a slot given back")
        with judge_on(port):
            assert sampler.wait(120) == 0, log.read_text()
    finally:
        kill(sampler)
    assert "the judge cannot be reached" in log.read_text() and "back unscored, to be retried" in log.read_text()
    records = documents(db_uri, "Record")
    assert not any(r.get("score_error") for r in records), records
    given_back = [r for r in records if r["released"]]
    assert given_back and all(r.get("score") is None and r["status"] == "failed" for r in given_back), records
    done = [r for r in records if r["status"] in FINISHED]
    assert len(done) == 2 and all(r["score"] == 1.0 and r["failures"] == 0 for r in done), records
    assert [t["status"] for t in documents(db_uri, "Task")] == ["completed"]


def test_a_judge_that_stays_down_stops_the_sampler_after_its_failure_limit(db_uri: str, tmp_path: Path,
                                                                          tiny_model_dir: Path,
                                                                          standin: StandInProcess) -> None:
    """Failures kept as data, not retried for ever: each trajectory the judge cannot score is given back as
    ``judge_unavailable``; after ``--max_consecutive_failures`` in a row the sampler exits non-zero with a message
    that names the failure class and the count, and leaves nothing ``running``."""
    sampler, log = start_sampler(db_uri, tmp_path, tiny_model_dir, standin, free_port(),
                                 "--max_consecutive_failures", "3", unavailable_retry_s=1)
    try:
        assert sampler.wait(180) == 1, log.read_text()
    finally:
        kill(sampler)
    text = log.read_text()
    assert "agentrl sample: error: sampler " in text, text[-3000:]
    assert "3 trajectories in a row failed for infrastructure (3 judge_unavailable; last error: " in text
    assert "--max_consecutive_failures 3 sets this limit" in text
    records = documents(db_uri, "Record")
    assert sum(r.get("failure_class") == "judge_unavailable" for r in records) >= 3, records
    assert not [r for r in records if r["status"] == "running"], records
    assert all(r.get("score") is None and r["failures"] == 0 for r in records), records
    assert [t["status"] for t in documents(db_uri, "Task")] == ["interrupted"]
