"""Samplers and evaluations against a server that behaves like a real SGLang, not our engine: the SGLang stand-in
(``tests/sglang_standin.py``, a real HTTP server process) fills every omitted sampling parameter from Qwen3's
preferred defaults and reports ``weight_version`` "default", as SGLang does. The real ``agentrl sample`` and
``agentrl eval`` commands must still sample with their own parameters and stamp tokens with policy version 0."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollout_fixtures import agentrl_cmd, documents, run_env, upload
from sglang_standin import StandInProcess

pytestmark = pytest.mark.slow

QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.5,
                  "repetition_penalty": 1.05}
REPLY = "The product is \\boxed{42}."


@pytest.fixture
def standin(tiny_model_dir: Path) -> Iterator[StandInProcess]:
    """A stand-in whose every reply is ``REPLY`` (then EOS) in the tiny model's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id]
    with StandInProcess(ids, REPLY, QWEN3_DEFAULTS) as server:
        yield server


def write_tasks(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": "What is 6 * 7?", "answer": "42"}) + "\n"
                            for i in range(2)))
    return path


def run(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    done = subprocess.run(agentrl_cmd(*args), capture_output=True, text=True, env=run_env(), timeout=240)
    assert done.returncode == expect, done.stdout + done.stderr
    return done


def used(standin: StandInProcess) -> list[dict]:
    return [request["sampling_params_used"] for request in standin.requests()]


def test_sampler_samples_with_its_own_parameters_and_stamps_version_0(
        db_uri: str, tmp_path: Path, tiny_model_dir: Path, standin: StandInProcess) -> None:
    upload(db_uri, write_tasks(tmp_path / "tasks.jsonl"), "--num_generations", "2")
    done = run("sample", "--db_connection_string", db_uri, "--model_name_or_path", str(tiny_model_dir),
               "--inference_urls", standin.url, "--max_turns", "2", "--max_new_tokens", "32",
               "--presence_penalty", "0.5", "--allow_biased_sampling", "true", "--exit_when_done", "true",
               "--zero_variance_threshold", "0", "--drop_zero_advantage", "false")
    assert "sampler done: 4 trajectories, 4 scored" in done.stdout
    assert done.stderr.count("biases the trainer's importance ratio") == 1  # allowed on the train split: warned

    calls = used(standin)
    assert len(calls) == 4
    for params in calls:  # the sampler's values, not the server's preferred ones
        assert params == {"max_new_tokens": 32, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                          "presence_penalty": 0.5, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    stored = documents(db_uri, "DispatchedSamplingTask")
    assert len(stored) == 4
    for call in stored:
        assert call["weight_version"] == 0  # SGLang's "default": the run's initial policy
        assert set(call["output_logprobs"]) == {-1.0}  # the stand-in's logprobs at temperature 1
    assert {r["policy_version"] for r in documents(db_uri, "Record")} == {0}
    samples = documents(db_uri, "DBRecordData")
    assert len(samples) == 4
    for sample in samples:
        versions = {v for v, m in zip(sample["versions"], sample["loss_mask"]) if m}
        assert versions == {0}  # not -1: the trainer counts these tokens as produced by version 0


def test_eval_sends_its_sampling_parameters(db_uri: str, tmp_path: Path, tiny_model_dir: Path,
                                            standin: StandInProcess) -> None:
    common = ["eval", "--db_connection_string", db_uri, "--tasks", str(write_tasks(tmp_path / "tasks.jsonl")),
              "--inference_urls", standin.url, "--model_name_or_path", str(tiny_model_dir), "--scorer", "math",
              "--answer_schema", "boxed", "--max_turns", "2", "--max_new_tokens", "32", "--json"]
    greedy = json.loads(run(*common).stdout)
    assert greedy["metrics"]["accuracy"] == 1.0 and greedy["model"]["weight_version"] == "default"
    assert used(standin) == [{"max_new_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}] * 2

    sampled = json.loads(run(*common, "--preferred_sampling_params", '{"temperature": 0.8, "top_p": 0.9}',
                             "--top_k", "5", "--frequency_penalty", "0.25").stdout)
    assert not sampled["reused"] and sampled["key"] != greedy["key"]
    assert used(standin)[2:] == [{"max_new_tokens": 32, "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.0,
                                  "presence_penalty": 0.0, "frequency_penalty": 0.25,
                                  "repetition_penalty": 1.0}] * 2


def test_rl_refuses_sampling_whose_logprobs_are_not_the_sampled_distribution(db_uri: str) -> None:
    """The engine reports logprobs before top-p/top-k/min-p truncation and after penalties (SGLang's convention):
    on the train split those settings would bias the importance ratio, so the sampler refuses them (exit 2) before
    touching the database; evaluation and --allow_biased_sampling take them."""
    for flags in (["--top_p", "0.9"], ["--top_k", "20"], ["--min_p", "0.05"], ["--frequency_penalty", "0.1"],
                  ["--preferred_sampling_params", '{"top_p": 0.95, "top_k": 20, "presence_penalty": 1.5}']):
        done = run("sample", "--db_connection_string", db_uri, *flags, expect=2)
        assert "on the train split" in done.stderr and "--allow_biased_sampling true" in done.stderr, done.stderr
        assert flags[0].lstrip("-") in done.stderr or "top_p 0.95" in done.stderr
    from agentrl.rollout.config import SamplerConfig

    assert SamplerConfig(split="test", rollout={"top_p": 0.9}).rollout.top_p == 0.9
    assert SamplerConfig(rollout={"top_p": 0.9, "temperature": 0.0}).rollout.top_p == 0.9  # greedy: no truncation
    assert SamplerConfig(rollout={"top_k": 20}, allow_biased_sampling=True).rollout.top_k == 20


def test_a_flag_contradicting_preferred_sampling_params_is_an_error(db_uri: str) -> None:
    done = run("sample", "--db_connection_string", db_uri, "--temperature", "0.7",
               "--preferred_sampling_params", '{"temperature": 1, "top_p": 1}', expect=2)
    assert "--temperature 0.7" in done.stderr and "--preferred_sampling_params temperature=1" in done.stderr
    done = run("eval", "--db_connection_string", db_uri, "--tasks", "x.jsonl",
               "--preferred_sampling_params", '{"temprature": 1}', expect=2)
    assert "temprature" in done.stderr and "top_p" in done.stderr


def test_an_aborted_generation_is_retried_and_never_trained(db_uri: str, tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    """SGLang answers an aborted request (shutdown, /abort_request) with finish_reason abort and the tokens so far:
    that is the service's doing, not the model's answer, so the generation is retried (an infrastructure failure
    is never scored) and the cut turn is never trained."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.eos_token_id]
    upload(db_uri, write_tasks(tmp_path / "tasks.jsonl"), "--num_generations", "2")
    with StandInProcess(ids, REPLY, abort_first=1) as server:
        done = run("sample", "--db_connection_string", db_uri, "--model_name_or_path", str(tiny_model_dir),
                   "--inference_urls", server.url, "--max_turns", "2", "--max_new_tokens", "32", "--exit_when_done",
                   "true", "--zero_variance_threshold", "0", "--drop_zero_advantage", "false")
    assert "aborted a generation; trying another service" in done.stderr
    calls = documents(db_uri, "DispatchedSamplingTask")
    assert len(calls) == 4 and {c["status"] for c in calls} == {"completed"}
    assert all(c["output_ids"] == ids for c in calls), "a cut turn was kept"
    assert {r["outcome"] for r in documents(db_uri, "Record")} == {"answer"}
    samples = documents(db_uri, "DBRecordData")
    assert len(samples) == 4
    for sample in samples:
        assert [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m] == ids


def test_a_sampler_held_back_by_admission_still_recovers_lost_slots(
        db_uri: str, tmp_path: Path, tiny_model_dir: Path, standin: StandInProcess) -> None:
    """A dead sampler held both slots of the only group: they count against admission, so a new sampler is never
    admitted to start a group — it must still take the expired leases over, or the run never ends."""
    import asyncio

    from agentrl.store import Store

    one_task = tmp_path / "task.jsonl"
    one_task.write_text(json.dumps({"id": "q0", "question": "What is 6 * 7?", "answer": "42"}) + "\n")
    upload(db_uri, one_task, "--num_generations", "2")

    async def die_holding_two_slots() -> None:
        async with Store(db_uri, lease_s=1.0) as store:
            assert await store.slots.claim("train", "dead-sampler") is not None
            assert await store.slots.claim("train", "dead-sampler") is not None

    asyncio.run(die_holding_two_slots())
    done = subprocess.run(agentrl_cmd(
        "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(tiny_model_dir),
        "--inference_urls", standin.url, "--max_turns", "2", "--max_new_tokens", "32", "--exit_when_done", "true",
        "--lease_s", "2", "--train_batch_size", "1", "--max_staleness", "0", "--zero_variance_threshold", "0",
        "--drop_zero_advantage", "false"), capture_output=True, text=True, env=run_env(), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    records = documents(db_uri, "Record")
    # the dead sampler's attempts were retired, both slots sampled again as second attempts
    assert sorted((r["attempt"], r["status"]) for r in records) == [(1, "failed"), (1, "failed"), (2, "ready"),
                                                                     (2, "ready")], records
    assert [t["status"] for t in documents(db_uri, "Task")] == ["completed"]
