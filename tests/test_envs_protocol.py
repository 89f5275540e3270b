"""The AgentGym HTTP protocol both ways: our server (real `agentrl envs serve` processes) and our client.

Per environment: payload shapes of create/reset/step/observation/close, the banner, AgentGym's error bodies (bad
id, step after done, bad task index), FastAPI's 422 for a missing field, independent instances, the idle sweep;
our client against our server, and against an AgentGym-*shaped* TextCraft server. That stand-in is written here
(its routes and payloads follow AgentGym's ``agentenv_textcraft`` server.py / env_wrapper.py) because AgentGym's
own package cannot be installed offline; it serves the counting game below instead of TextCraft's recipes, which
the wire format does not depend on.

The counting game is a real :class:`Environment`, served through a plugin reference (``test_envs_protocol:
counter_spec``), which the server process imports with this directory on its ``PYTHONPATH``. The built-in
environments get the same conformance checks when their modules exist (skipped otherwise).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult
from agentrl.envs.client import AgentGymClient, EnvServerError, EnvUnavailable, episode_reward
from agentrl.envs.local import EnvServerProcess, start_local_server
from agentrl.envs.protocol import (
    FORMATS,
    create_body,
    first_observation,
    read_observation,
    read_step,
    reset_body,
    wire_first_observation,
    wire_format,
)

pytestmark = pytest.mark.slow

TESTS = str(Path(__file__).parent)
PLUGIN_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
COUNTER = "test_envs_protocol:counter_spec"
COUNTER_TASKS = 10


# --- the counting game -------------------------------------------------------------------------------------------

class CountingGame(Environment):
    """Task k: reach exactly ``k % 4 + 2`` from 0 with ``add 1|2|3`` (reward 1 and done; passing it: done, 0).
    ``wait SECONDS`` is a slow step that changes nothing."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.count = 0
        self.done = False
        self._observation = ""

    def reset(self, data_idx: int) -> str:
        if not 0 <= data_idx < COUNTER_TASKS:
            raise EnvError(f"counter task {data_idx} does not exist")
        self.target, self.count, self.done = data_idx % 4 + 2, 0, False
        self._observation = f"Count to {self.target}. The count is 0."
        return self._observation

    def step(self, action: str) -> StepResult:
        if self.target is None:
            raise EnvError("counter: reset first")
        if self.done:
            raise EnvError("counter: the game is over")
        reward = 0.0
        if match := re.fullmatch(r"add ([123])", action.strip()):
            self.count += int(match[1])
            self.done = self.count >= self.target
            reward = 1.0 if self.count == self.target else 0.0
            self._observation = f"The count is {self.count}." + (" You won." if reward else "")
        elif match := re.fullmatch(r"wait ([0-9.]+)", action.strip()):
            time.sleep(float(match[1]))
            self._observation = f"You waited. The count is {self.count}."
        else:
            self._observation = f"Unknown action {action!r}: use add 1, add 2 or add 3."
        return StepResult(observation=self._observation, reward=reward, done=self.done)

    def observation(self) -> str:
        return self._observation

    def detail(self) -> dict[str, Any]:
        return {"target": self.target, "count": self.count}


def counter_spec(oracle: bool = True) -> EnvSpec:
    return EnvSpec(name="counter", factory=CountingGame, splits={"train": range(0, 8), "test": range(8, 10)},
                   instruction="Count to the target. End with 'Action: add N' (N is 1, 2 or 3).",
                   oracle=(lambda k: ["add 1"] * (k % 4 + 2)) if oracle else None, max_turns=8)


def counter_spec_without_oracle() -> EnvSpec:
    return counter_spec(oracle=False)


# --- servers -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def counter_url() -> Iterator[str]:
    url, stop = start_local_server(COUNTER, env=PLUGIN_ENV)
    try:
        yield url
    finally:
        stop()


def builtin_url(name: str) -> Iterator[str]:
    if importlib.util.find_spec(f"agentrl.envs.{name}") is None:
        pytest.skip(f"agentrl.envs.{name} is not written yet")
    url, stop = start_local_server(name)
    try:
        yield url
    finally:
        stop()


@pytest.fixture(scope="module")
def textcraft_url() -> Iterator[str]:
    yield from builtin_url("textcraft")


@pytest.fixture(scope="module")
def babyai_url() -> Iterator[str]:
    yield from builtin_url("babyai")


@pytest.fixture(scope="module")
def sciworld_url() -> Iterator[str]:
    yield from builtin_url("sciworld")


@pytest.fixture()
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def post(http: httpx.Client, url: str, path: str, body: Any = None) -> Any:
    response = http.post(url + path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def get(http: httpx.Client, url: str, path: str, **params: Any) -> Any:
    response = http.get(url + path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def open_ids(http: httpx.Client, url: str) -> list[int]:
    return get(http, url, "/instances")["ids"]


# --- the generic dialect (the counting game) ----------------------------------------------------------------------

def test_banner_health_and_payload_shapes(counter_url: str, http: httpx.Client) -> None:
    assert get(http, counter_url, "/") == "This is environment counter."
    created = post(http, counter_url, "/create")
    assert set(created) == {"id"} and isinstance(created["id"], int)
    instance = created["id"]
    reset = post(http, counter_url, "/reset", {"id": instance, "data_idx": 3})
    assert reset == {"id": instance, "observation": "Count to 5. The count is 0.", "reward": 0.0, "score": 0.0,
                     "done": False}
    step = post(http, counter_url, "/step", {"id": instance, "action": "add 2"})
    assert step == {"observation": "The count is 2.", "reward": 0.0, "score": 0.0, "done": False}
    assert get(http, counter_url, "/observation", id=instance) == "The count is 2."
    detail = get(http, counter_url, "/detail", id=instance)
    assert detail["target"] == 5 and detail["count"] == 2 and detail["done"] is False
    assert instance in open_ids(http, counter_url)
    health = get(http, counter_url, "/health")
    assert health["status"] == "ok" and health["env"] == "counter" and health["instances"] >= 1
    assert post(http, counter_url, "/close", {"id": instance}) is True
    assert post(http, counter_url, "/close", {"id": instance}) is False
    assert instance not in open_ids(http, counter_url)


def test_agentgym_error_bodies(counter_url: str, http: httpx.Client) -> None:
    assert post(http, counter_url, "/step", {"id": 10_000, "action": "add 1"}) == {
        "error": "The id 10000 is not valid."}
    assert get(http, counter_url, "/observation", id=-1) == {"error": "The id -1 is not valid."}
    instance = post(http, counter_url, "/create")["id"]
    assert post(http, counter_url, "/step", {"id": instance, "action": "add 1"}) == {
        "error": f"The task with environment {instance} has not been reset: call /reset with a data_idx first."}
    for bad in (COUNTER_TASKS, -1):
        error = post(http, counter_url, "/reset", {"id": instance, "data_idx": bad})["error"]
        assert f"data_idx {bad} is out of range" in error and "0 to 9" in error
    post(http, counter_url, "/reset", {"id": instance, "data_idx": 0})  # target 2
    assert post(http, counter_url, "/step", {"id": instance, "action": "add 2"})["done"] is True
    assert post(http, counter_url, "/step", {"id": instance, "action": "add 1"}) == {
        "error": f"The task with environment {instance} has finished."}
    assert get(http, counter_url, "/observation", id=instance) == "The count is 2. You won."  # only step refused
    post(http, counter_url, "/reset", {"id": instance, "data_idx": 1})  # a new episode on the same instance
    assert post(http, counter_url, "/step", {"id": instance, "action": "add 1"})["done"] is False
    post(http, counter_url, "/close", {"id": instance})
    assert post(http, counter_url, "/step", {"id": instance, "action": "add 1"}) == {
        "error": f"The id {instance} is not valid."}


def test_missing_fields_and_bad_json_are_fastapi_422(counter_url: str, http: httpx.Client) -> None:
    response = http.post(counter_url + "/step", json={"id": 0})
    assert response.status_code == 422
    assert response.json()["detail"][0]["type"] == "missing" and response.json()["detail"][0]["loc"] == [
        "body", "action"]
    response = http.post(counter_url + "/reset", json={"id": 0})  # data_idx is required (as BabyAI/SciWorld)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "data_idx"]
    response = http.post(counter_url + "/step", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"
    response = http.get(counter_url + "/observation")
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "id"]


def test_instances_are_independent(counter_url: str, http: httpx.Client) -> None:
    first, second = (post(http, counter_url, "/create")["id"] for _ in range(2))
    assert first != second
    post(http, counter_url, "/reset", {"id": first, "data_idx": 2})
    post(http, counter_url, "/reset", {"id": second, "data_idx": 3})
    post(http, counter_url, "/step", {"id": first, "action": "add 3"})
    assert get(http, counter_url, "/observation", id=second) == "Count to 5. The count is 0."
    assert get(http, counter_url, "/detail", id=first)["count"] == 3
    for instance in (first, second):
        post(http, counter_url, "/close", {"id": instance})


async def test_one_instance_is_serialised_and_instances_run_in_parallel(counter_url: str) -> None:
    async with AgentGymClient("counter", counter_url) as client:
        one, other = await client.create(), await client.create()
        for instance in (one, other):
            await client.reset(instance, 0)
        start = time.monotonic()
        await asyncio.gather(client.step(one, "wait 0.5"), client.step(one, "wait 0.5"))
        serial = time.monotonic() - start
        start = time.monotonic()
        await asyncio.gather(client.step(one, "wait 0.5"), client.step(other, "wait 0.5"))
        parallel = time.monotonic() - start
        for instance in (one, other):
            await client.close(instance)
    assert serial >= 1.0, serial
    assert parallel < 0.9, parallel


def test_idle_instances_are_closed_by_the_sweep(http: httpx.Client) -> None:
    url, stop = start_local_server(COUNTER, env=PLUGIN_ENV, instance_ttl_s=0.5)
    try:
        idle, busy = (post(http, url, "/create")["id"] for _ in range(2))
        post(http, url, "/reset", {"id": busy, "data_idx": 0})
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # keep `busy` in use; `idle` is never touched again
            post(http, url, "/step", {"id": busy, "action": "wait 0.1"})
        assert open_ids(http, url) == [busy]
        assert post(http, url, "/close", {"id": idle}) is False
        assert post(http, url, "/reset", {"id": idle, "data_idx": 0}) == {"error": f"The id {idle} is not valid."}
        time.sleep(1.5)
        assert open_ids(http, url) == []
    finally:
        stop()


# --- our client against our server ------------------------------------------------------------------------------

async def test_client_plays_an_episode(counter_url: str) -> None:
    async with AgentGymClient("counter", counter_url) as client:
        assert await client.health() == "This is environment counter."
        instance = await client.create()
        assert await client.reset(instance, 6) == "Count to 4. The count is 0."
        steps = [await client.step(instance, "add 3"), await client.step(instance, "add 1")]
        assert [s.done for s in steps] == [False, True] and steps[-1].observation == "The count is 4. You won."
        assert steps[-1].info == {"score": 1.0} and episode_reward(steps) == 1.0
        assert await client.observation(instance) == "The count is 4. You won."
        with pytest.raises(EnvServerError, match=f"^The task with environment {instance} has finished.$"):
            await client.step(instance, "add 1")
        assert await client.close(instance) is True
        assert await client.close(instance) is False
        with pytest.raises(EnvServerError, match=f"^The id {instance} is not valid.$"):
            await client.reset(instance, 0)


async def test_unreachable_server_is_env_unavailable_after_retries() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with AgentGymClient("counter", f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01) as client:
        with pytest.raises(EnvUnavailable, match="after 3 attempts: ConnectError"):
            await client.create()  # never sent: retried even though create is not idempotent
        with pytest.raises(EnvUnavailable):
            await client.health()
    assert issubclass(EnvUnavailable, EnvError) and not issubclass(EnvUnavailable, EnvServerError)


class DroppingServer:
    """Accepts connections, reads the request, closes without answering; counts the requests."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            with connection:
                if connection.recv(65536):
                    self.requests += 1


async def test_requests_that_may_have_arrived_are_retried_only_when_idempotent() -> None:
    server = DroppingServer()
    try:
        async with AgentGymClient("counter", server.url, retries=2, backoff_s=0.01) as client:
            with pytest.raises(EnvUnavailable, match="not retried"):
                await client.create()
            assert server.requests == 1
            with pytest.raises(EnvUnavailable, match="not retried"):
                await client.step(0, "add 1")
            assert server.requests == 2
            with pytest.raises(EnvUnavailable, match="after 3 attempts"):
                await client.reset(0, 1)
            assert server.requests == 5
    finally:
        server.sock.close()


# --- our client against an AgentGym-shaped TextCraft server ----------------------------------------------------
# (the request models of AgentGym's agentenv_textcraft/model.py; at module level, where FastAPI resolves them)

class CreateRequestBody(BaseModel):
    commands: str | None = None
    goal: str | None = None


class StepRequestBody(BaseModel):
    id: int
    action: str


class ResetRequestBody(BaseModel):
    id: int
    data_idx: int | None = 0


class CloseRequestBody(BaseModel):
    id: int


def agentgym_textcraft_app() -> FastAPI:
    """AgentGym TextCraft's wire format (agentenv_textcraft server.py + env_wrapper.py), over the counting game:
    create takes a body with optional commands/goal and loads task ``id``; reset's data_idx defaults to 0; errors
    are ``{"error": str(e)}``; close answers a bool; step after done is not checked by the wrapper."""
    app = FastAPI()
    games: dict[int, CountingGame] = {}
    info: dict[int, dict[str, Any]] = {}
    next_id = [0]

    def check(instance: int) -> None:
        if instance not in info:
            raise NameError(f"The id {instance} is not valid.")

    @app.get("/")
    def hello() -> str:
        return "This is environment TextCraft."

    @app.post("/create")
    async def create(body: CreateRequestBody) -> Any:
        instance = next_id[0]
        next_id[0] += 1
        game = CountingGame()
        observation = game.reset(instance % COUNTER_TASKS)
        games[instance] = game
        info[instance] = {"observation": observation, "done": False, "reward": 0, "deleted": False}
        return {"id": instance, "observation": observation, "done": False, "reward": 0}

    @app.post("/step")
    def step(body: StepRequestBody) -> Any:
        try:
            check(body.id)
            result = games[body.id].step(body.action)
            payload = {"observation": result.observation, "reward": result.reward, "done": result.done}
            info[body.id].update(payload)
        except Exception as error:  # noqa: BLE001 - AgentGym's wrapper turns every exception into a body
            payload = {"error": f"{error}"}
        return payload

    @app.post("/reset")
    def reset(body: ResetRequestBody) -> Any:
        try:
            check(body.id)
            observation = games[body.id].reset(body.data_idx)
            info[body.id].update({"observation": observation, "done": False, "reward": 0, "deleted": False})
            return {"id": body.id, "observation": observation, "done": False, "reward": 0}
        except Exception as error:  # noqa: BLE001
            return {"error": str(error)}

    @app.get("/observation")
    def observation(id: int) -> Any:
        try:
            check(id)
            return info[id]["observation"]
        except Exception as error:  # noqa: BLE001
            return {"error": str(error)}

    @app.post("/close")
    def close(body: CloseRequestBody) -> bool:
        if body.id not in games:
            return False
        del games[body.id], info[body.id]
        return True

    return app


@pytest.fixture(scope="module")
def agentgym_textcraft_url() -> Iterator[str]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(agentgym_textcraft_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


async def test_client_against_an_agentgym_shaped_textcraft_server(agentgym_textcraft_url: str) -> None:
    async with AgentGymClient("textcraft", agentgym_textcraft_url) as client:
        assert await client.health() == "This is environment TextCraft."
        first, second = await client.create(), await client.create()
        assert (first, second) == (0, 1)  # create loaded tasks 0 and 1; the explicit reset decides
        assert await client.reset(second, 7) == "Count to 5. The count is 0."
        steps = [await client.step(second, action) for action in ("add 3", "jump", "add 2")]
        assert [s.reward for s in steps] == [0.0, 0.0, 1.0] and steps[-1].done
        assert steps[1].observation == "Unknown action 'jump': use add 1, add 2 or add 3."
        assert all(s.info == {} for s in steps) and episode_reward(steps) == 1.0  # no score: the sum
        assert await client.observation(second) == "The count is 5. You won."
        with pytest.raises(EnvServerError, match="^The id 99 is not valid.$"):
            await client.step(99, "add 1")
        assert await client.close(first) is True and await client.close(first) is False
        assert await client.close(second) is True


# --- the wire format's readers -----------------------------------------------------------------------------------

def test_request_bodies_and_lenient_readers() -> None:
    assert wire_format("WebShop").id_field == "env_idx" and wire_format("alfworld").task_field == "game"
    assert wire_format("my_env").banner == "This is environment my_env." and wire_format("my_env").served
    assert create_body(FORMATS["searchqa"], 5) == {"id": 5} and create_body(FORMATS["textcraft"], 5) == {}
    assert reset_body(FORMATS["alfworld"], 2, 7) == {"id": 2, "game": 7, "world_type": "Text"}
    assert reset_body(FORMATS["sqlgym"], 2, 7) == {"env_idx": 2, "item_id": 7}
    assert read_observation(["the page", None]) == "the page"  # WebShop/SQLGym reset
    assert read_observation("a question") == "a question"  # SearchQA reset
    step = read_step({"state": "results", "reward": 0.5, "done": True, "info": None})
    assert (step.observation, step.reward, step.done, step.info) == ("results", 0.5, True, {})
    sciworld = {"task_name": "boil", "var_num": 0, "task_description": "Your task is to boil water.",
                "observation": "This room is called the kitchen.", "reward": 0, "score": 0}
    assert first_observation(FORMATS["sciworld"], sciworld) == (
        "Your task is to boil water.\nThis room is called the kitchen.")
    assert first_observation(FORMATS["babyai"], sciworld) == "This room is called the kitchen."
    first = "Your task is to boil water.\nThis room is called the kitchen."  # what the server strips and sends
    assert wire_first_observation(FORMATS["sciworld"], first, sciworld) == sciworld["observation"]
    scored = [StepResult(observation="", reward=r, info={"score": s}) for r, s in ((10, 10), (-5, 5), (60, 65))]
    assert episode_reward(scored) == 65.0


# --- the built-in environments ------------------------------------------------------------------------------------

def test_textcraft_conformance(textcraft_url: str, http: httpx.Client) -> None:
    from agentrl.envs.registry import get_spec

    spec = get_spec("textcraft")
    assert get(http, textcraft_url, "/") == "This is environment TextCraft."
    created = post(http, textcraft_url, "/create", {})
    instance = created["id"]
    # AgentGym's fields, and ours: the state's key (the goal and the inventory), which AgentGym's clients ignore
    assert set(created) == {"id", "observation", "done", "reward", "state_key"}
    local = spec.factory()
    assert created["observation"] == local.reset(instance % spec.num_tasks)  # AgentGym: task = id
    assert created["state_key"] == local.state_key()
    reset = post(http, textcraft_url, "/reset", {"id": instance})  # data_idx defaults to 0, as AgentGym's
    assert set(reset) == {"id", "observation", "done", "reward", "state_key"}
    assert reset["observation"] == local.reset(0) and reset["state_key"] == local.state_key()
    step = post(http, textcraft_url, "/step", {"id": instance, "action": "get 1 oak logs"})
    assert set(step) == {"observation", "reward", "done", "state_key"}
    assert step["observation"] == local.step("get 1 oak logs").observation and step["state_key"] == local.state_key()
    assert get(http, textcraft_url, "/observation", id=instance) == step["observation"]
    assert post(http, textcraft_url, "/create", {"commands": "craft 1 x using 1 y", "goal": "x"})["error"]
    assert post(http, textcraft_url, "/close", {"id": instance}) is True
    assert post(http, textcraft_url, "/step", {"id": instance, "action": "inventory"}) == {
        "error": f"The id {instance} is not valid."}


async def test_textcraft_oracle_episode_over_http_equals_in_process(textcraft_url: str) -> None:
    from agentrl.envs.registry import get_spec

    spec = get_spec("textcraft")
    data_idx = spec.split("train")[5]
    local = spec.factory()
    async with AgentGymClient("textcraft", textcraft_url) as client:
        instance = await client.create()
        assert await client.reset_keyed(instance, data_idx) == (local.reset(data_idx), local.state_key())
        steps = []
        for action in spec.oracle(data_idx):
            steps.append(await client.step(instance, action))
            assert steps[-1] == local.step(action).model_copy(update={"info": {"state_key": local.state_key()}})
        assert steps[-1].done and episode_reward(steps) == spec.success_reward
        with pytest.raises(EnvServerError, match="has finished"):
            await client.step(instance, "inventory")
        await client.close(instance)


async def test_babyai_conformance(babyai_url: str, http: httpx.Client) -> None:
    from agentrl.envs.registry import get_spec

    spec = get_spec("babyai")
    assert get(http, babyai_url, "/") == "This is environment BabyAI."
    instance = post(http, babyai_url, "/create")["id"]
    assert http.post(babyai_url + "/reset", json={"id": instance}).status_code == 422  # data_idx required
    data_idx = spec.split("train")[0]
    actions = spec.oracle(data_idx)
    reset = post(http, babyai_url, "/reset", {"id": instance, "data_idx": data_idx})
    assert set(reset) == {"observation", "reward", "score", "deleted", "done", "state_key"}
    local = spec.factory()
    assert reset["observation"] == local.reset(data_idx) and reset["state_key"] == local.state_key()
    assert set(get(http, babyai_url, "/observation", id=instance)) == {"observation", "reward", "score", "done",
                                                                       "deleted", "state_key"}
    async with AgentGymClient("babyai", babyai_url) as client:
        steps = [await client.step(instance, action) for action in actions]
    assert set(post(http, babyai_url, "/reset", {"id": instance, "data_idx": data_idx})) == set(reset)
    steps_again = [post(http, babyai_url, "/step", {"id": instance, "action": a}) for a in actions]
    assert all(set(s) == {"observation", "reward", "score", "done", "state_key"} for s in steps_again)
    assert steps[-1].done and "score" in steps[-1].info
    assert episode_reward(steps) >= spec.success_reward
    finished = {"error": f"The task with environment {instance} has finished."}
    assert post(http, babyai_url, "/step", {"id": instance, "action": "turn left"}) == finished
    assert get(http, babyai_url, "/observation", id=instance) == finished
    assert post(http, babyai_url, "/close", {"id": instance}) is True


async def test_sciworld_conformance(sciworld_url: str, http: httpx.Client) -> None:
    from agentrl.envs.registry import get_spec

    spec = get_spec("sciworld")
    assert get(http, sciworld_url, "/") == "This is environment ScienceWorld."
    instance = post(http, sciworld_url, "/create")["id"]
    data_idx = spec.split("train")[0]
    reset = post(http, sciworld_url, "/reset", {"id": instance, "data_idx": data_idx})
    assert set(reset) == {"task_name", "var_num", "task_description", "observation", "reward", "score", "deleted",
                          "done", "state_key"}  # ours: the state key, an extra field AgentGym's client ignores
    step = post(http, sciworld_url, "/step", {"id": instance, "action": "look around"})
    assert set(step) == {"observation", "reward", "score", "done", "state_key"}
    assert step["state_key"] == reset["state_key"]  # looking around changes nothing
    assert isinstance(get(http, sciworld_url, "/observation", id=instance), str)
    assert post(http, sciworld_url, "/close", {"id": instance}) is True
    assert post(http, sciworld_url, "/step", {"id": instance, "action": "look around"}) == {
        "error": f"The task with environment {instance} has been deleted."}
    local = spec.factory()
    try:  # AgentGym's client joins task_description and observation with a newline: so must the environment
        assert first_observation(FORMATS["sciworld"], reset) == local.reset(data_idx)
        assert reset["state_key"] == local.state_key()
    finally:
        local.close()


# --- local server processes ---------------------------------------------------------------------------------------

def test_unknown_environment_fails_to_start_with_the_reason() -> None:
    with pytest.raises(EnvError, match="unknown environment 'no_such_env'"):
        start_local_server("no_such_env", startup_timeout_s=60)


PARENT = """
import sys, time
from agentrl.envs.local import EnvServerProcess
server = EnvServerProcess(sys.argv[1], env={"PYTHONPATH": sys.argv[2]})
url = server.start()
print(server.process.pid, url, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_server_dies_with_the_process_that_started_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, COUNTER, PLUGIN_ENV["PYTHONPATH"]],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    server_pid = None
    try:
        pid_text, url = parent.stdout.readline().split()
        server_pid = int(pid_text)
        assert alive(server_pid) and httpx.get(url + "/").status_code == 200
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(server_pid), "the server outlived the process that started it"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/", timeout=2)
    finally:
        parent.kill()
        parent.wait()
        if server_pid is not None and alive(server_pid):  # the test failed: do not leave the server behind
            os.killpg(server_pid, signal.SIGKILL)


def test_stop_ends_the_server() -> None:
    server = EnvServerProcess(COUNTER, env=PLUGIN_ENV)
    with server:
        assert httpx.get(server.url + "/").json() == "This is environment counter."
        pid = server.process.pid
    assert not alive(pid) and server.process.returncode == 0
    server.stop()  # idempotent


def test_a_server_without_state_keys_gets_its_states_keyed_by_the_observation() -> None:
    """AgentGym's own servers send no ``state_key``: the client keys a state by a hash of the observation text (two
    different states behind one text share a key, which the per-turn estimators then treat as one state)."""
    from agentrl.envs.protocol import state_key_of

    assert state_key_of("Got 1 oak logs", {"observation": "Got 1 oak logs", "state_key": "goal|oak:1"}) == "goal|oak:1"
    plain = state_key_of("Got 1 oak logs", {"observation": "Got 1 oak logs", "reward": 0})
    assert plain.startswith("observation:") and plain == state_key_of("Got 1 oak logs", "Got 1 oak logs")
    assert plain != state_key_of("Got 2 oak logs", {}) and state_key_of("x", {"state_key": ""}).startswith("obs")
