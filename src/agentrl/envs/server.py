"""``agentrl envs serve``: one environment kind on AgentGym's HTTP routes (FastAPI), in its wire format.

Routes and payloads are AgentGym's (:mod:`agentrl.envs.protocol` has the per-environment table), plus two of
ours: ``GET /instances`` (the open instance ids and their count) and ``GET /health``.

Invariants:

- Instance ids are consecutive integers from 0, never reused; each is allocated on the event loop with no await
  between reading and advancing the counter, which serialises allocation as a lock would.
- Calls for one instance are serialised by its lock; environment work (build, reset, step, close) runs in a
  thread pool, so a slow instance holds up only its own callers. A call whose request is cancelled keeps the
  lock until its environment work has finished.
- An instance idle for longer than ``instance_ttl_s`` (and not in use) is closed by a background sweep: the
  backstop for clients that die without closing. Every instance is closed when the server shuts down.
- A closed or swept id is never valid again: it gets the environment's error for closed ids.

Logging: one line per instance created or closed, none per step.
"""

# No ``from __future__ import annotations`` here: FastAPI must see the request models built in create_app as
# real annotations, not as strings naming local variables it cannot resolve.

import asyncio
import base64
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Query
from pydantic import BaseModel, create_model

from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult
from agentrl.envs.protocol import (
    ERROR_FINISHED,
    ERROR_NOT_RESET,
    ERROR_NOT_VALID,
    IMAGE_FIELD,
    STATE_KEY_FIELD,
    ProtocolError,
    WireFormat,
    payload,
    wire_first_observation,
    wire_format,
)
from agentrl.listen import listening_socket, serve_until_stopped

logger = logging.getLogger(__name__)

DEFAULT_INSTANCE_TTL_S = 1800.0
DEFAULT_WORKERS = 32
PARENT_FD_ENV = "AGENTRL_ENVS_PARENT_FD"
"""When set, the read end of a pipe held open by the process that started this server: end of file (that process
exited, however it died) shuts the server down."""
READY_LINE = "agentrl envs: serving {name} at {url}"
EPISODE_FIELDS = ("id", "observation", "reward", "score", "done", "deleted")
"""The fields the server keeps per episode; the others of an instance's state come from the env's ``detail()``."""


@dataclass(eq=False)
class Instance:
    """One open environment instance and the state its responses are cut from."""

    id: int
    env: Environment
    state: dict[str, Any]
    """:data:`EPISODE_FIELDS` (AgentGym's names) over the environment's ``detail()`` at the last reset."""
    has_task: bool = False
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.last_used = time.monotonic()


class InstancePool:
    """The open instances of one environment kind, and the operations behind the routes (each returns the body)."""

    def __init__(self, spec: EnvSpec, fmt: WireFormat, *, instance_ttl_s: float, workers: int, images: bool = False):
        self.spec, self.fmt = spec, fmt
        self.images = images  # every observation also carries its picture (IMAGE_FIELD), where the env draws one
        self.instance_ttl_s = instance_ttl_s
        self.instances: dict[int, Instance] = {}
        self.next_id = 0
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"env-{spec.name}")

    # --- routes -------------------------------------------------------------------------------------------------

    async def create(self, commands: str | None, goal: str | None) -> Any:
        if commands is not None or goal is not None:
            return {"error": "custom crafting commands and goals are not supported by this server: reset the "
                             "instance to a task index (data_idx) instead"}
        instance_id = self.next_id
        self.next_id += 1
        try:
            env = await self._call(self.spec.factory)
        except Exception as error:  # noqa: BLE001 - any failure is the client's error body, as in AgentGym
            return self._failure("create", instance_id, error)
        instance = Instance(instance_id, env, {"id": instance_id, "deleted": False, "done": False})
        if self.fmt.create_loads_task:
            try:
                observation, detail = await self._call(_reset_env, env, instance_id % self.spec.num_tasks,
                                                       self.images)
            except Exception as error:  # noqa: BLE001
                await self._close_env(instance, "its first reset failed")
                return self._failure("create", instance_id, error)
            self._start_episode(instance, observation, detail)
        self.instances[instance_id] = instance
        logger.info("%s: created instance %d (%d open)", self.spec.name, instance_id, len(self.instances))
        return self._respond(self.fmt.create_fields, instance, "create")

    async def reset(self, instance_id: int, data_idx: int) -> Any:
        async with self._use(instance_id, "reset") as (instance, error):
            if error:
                return error
            if not 0 <= data_idx < self.spec.num_tasks:
                return {"error": f"data_idx {data_idx} is out of range: environment {self.spec.name} has tasks 0 "
                                 f"to {self.spec.num_tasks - 1}"}
            instance.has_task = False  # until this reset succeeds: never step a half-reset environment
            try:
                observation, detail = await self._call(_reset_env, instance.env, data_idx, self.images)
            except Exception as error:  # noqa: BLE001
                return self._failure("reset", instance_id, error)
            self._start_episode(instance, observation, detail)
            return self._respond(self.fmt.reset_fields, instance, "reset")

    async def step(self, instance_id: int, action: str) -> Any:
        async with self._use(instance_id, "step") as (instance, error):
            if error:
                return error
            try:
                result, key, image = await self._call(_step_env, instance.env, action, self.images)
            except Exception as error:  # noqa: BLE001
                return self._failure("step", instance_id, error)
            score = result.info.get("score", instance.state["score"] + result.reward)
            instance.state.update(observation=result.observation, reward=result.reward, score=float(score),
                                  done=result.done, **{STATE_KEY_FIELD: key, IMAGE_FIELD: image})
            return self._respond(self.fmt.step_fields, instance, "step")

    async def observation(self, instance_id: int) -> Any:
        async with self._use(instance_id, "observation") as (instance, error):
            if error:
                return error
            if self.fmt.observation_fields is None:
                return instance.state["observation"]
            return self._respond(self.fmt.observation_fields, instance, "observation")

    async def detail(self, instance_id: int) -> Any:
        async with self._use(instance_id, "detail") as (instance, error):
            if error:
                return error
            try:
                detail = await self._call(instance.env.detail)
            except Exception as error:  # noqa: BLE001
                return self._failure("detail", instance_id, error)
            return {**detail, **{key: instance.state[key] for key in EPISODE_FIELDS}}

    async def close(self, instance_id: int, reason: str = "closed by the client", *,
                    only_if_idle: bool = False) -> bool:
        instance = self.instances.get(instance_id)
        if instance is None:
            return False
        async with instance.lock:
            if instance.closed or (only_if_idle and not self._expired(instance)):
                return False
            instance.closed = True
            del self.instances[instance_id]
        await self._close_env(instance, reason)
        return True

    # --- lifecycle ----------------------------------------------------------------------------------------------

    async def sweep(self) -> list[int]:
        """Close the instances idle for longer than the TTL that nobody is using; returns their ids."""
        reason = f"idle for more than {self.instance_ttl_s:g}s"
        return [instance.id for instance in list(self.instances.values())
                if self._expired(instance) and not instance.lock.locked()
                and await self.close(instance.id, reason, only_if_idle=True)]

    async def sweep_forever(self) -> None:
        interval = min(max(self.instance_ttl_s / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception:  # the sweep must outlive one bad instance
                logger.warning("%s: the idle sweep failed", self.spec.name, exc_info=True)

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(i, "the server is shutting down") for i in list(self.instances)))
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- helpers ------------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def _use(self, instance_id: int, route: str):
        """Hold the instance's lock; yields ``(instance, None)``, or ``(None, error body)`` when refused."""
        instance = self.instances.get(instance_id)
        if instance is None:
            yield None, {"error": self._invalid_id_message(instance_id)}
            return
        async with instance.lock:
            instance.touch()
            try:
                if instance.closed:
                    yield None, {"error": self._invalid_id_message(instance_id)}
                elif route != "reset" and not instance.has_task:
                    yield None, {"error": ERROR_NOT_RESET.format(id=instance_id)}
                elif route in self.fmt.refused_when_done and instance.state["done"]:
                    yield None, {"error": ERROR_FINISHED.format(id=instance_id)}
                else:
                    yield instance, None
            finally:
                instance.touch()

    def _expired(self, instance: Instance) -> bool:
        return time.monotonic() - instance.last_used > self.instance_ttl_s

    def _invalid_id_message(self, instance_id: int) -> str:
        if 0 <= instance_id < self.next_id and instance_id not in self.instances:
            return self.fmt.closed_error.format(id=instance_id)
        return ERROR_NOT_VALID.format(id=instance_id)

    def _start_episode(self, instance: Instance, observation: str, detail: dict[str, Any]) -> None:
        state = {**detail, "id": instance.id, "reward": 0.0, "score": 0.0, "done": False, "deleted": False}
        state["observation"] = wire_first_observation(self.fmt, observation, state)
        instance.state = state
        instance.has_task = True

    def _respond(self, fields: tuple[str, ...], instance: Instance, what: str) -> dict[str, Any]:
        """The response of ``fields``; one that carries an observation also carries the environment's state key
        (an extra field AgentGym clients ignore), where it has one."""
        extra = {name: instance.state[name] for name in (STATE_KEY_FIELD, IMAGE_FIELD)
                 if instance.state.get(name) is not None and "observation" in fields}
        try:
            return {**payload(fields, instance.state, what=what), **extra}
        except ProtocolError as error:
            logger.error("%s instance %d: %s", self.spec.name, instance.id, error)
            return {"error": f"environment {self.spec.name}: {error}"}

    def _failure(self, what: str, instance_id: int, error: Exception) -> dict[str, str]:
        if isinstance(error, EnvError):
            return {"error": str(error)}
        logger.warning("%s instance %d: %s failed", self.spec.name, instance_id, what, exc_info=error)
        return {"error": f"{type(error).__name__}: {error}" if str(error) else type(error).__name__}

    async def _close_env(self, instance: Instance, reason: str) -> None:
        try:
            await self._call(instance.env.close)
        except Exception:  # the instance is gone either way; say why its resources may linger
            logger.warning("%s: closing instance %d failed", self.spec.name, instance.id, exc_info=True)
        logger.info("%s: closed instance %d, %s (%d open)", self.spec.name, instance.id, reason,
                    len(self.instances))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run environment work in the pool. If the awaiting request is cancelled, wait for the work to end before
        letting the cancellation through, so the instance's lock is never released while its env is busy."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                try:
                    await asyncio.wait({future})
                except asyncio.CancelledError:
                    continue
            raise


def _reset_env(env: Environment, data_idx: int, images: bool) -> tuple[str, dict[str, Any]]:
    observation = env.reset(data_idx)
    return observation, {**env.detail(), STATE_KEY_FIELD: env.state_key(), IMAGE_FIELD: _picture(env, images)}


def _step_env(env: Environment, action: str, images: bool) -> tuple[StepResult, str | None, str | None]:
    return env.step(action), env.state_key(), _picture(env, images)


def _picture(env: Environment, images: bool) -> str | None:
    """The environment's picture of its observation, base64 (with ``images``, where it draws one)."""
    data = env.image() if images else None
    return None if data is None else base64.b64encode(data).decode("ascii")


def create_app(spec: EnvSpec, *, instance_ttl_s: float = DEFAULT_INSTANCE_TTL_S,
               workers: int = DEFAULT_WORKERS, images: bool = False) -> FastAPI:
    """The FastAPI app serving ``spec`` in its AgentGym wire format (see the module docstring)."""
    fmt = wire_format(spec.name)
    if not fmt.served:
        raise ValueError(f"{spec.name!r} names another AgentGym server's dialect, which this server does not speak; "
                         "serve the environment under another name (it then gets the generic dialect)")
    if instance_ttl_s <= 0:
        raise ValueError(f"instance_ttl_s must be positive, got {instance_ttl_s}")
    pool = InstancePool(spec, fmt, instance_ttl_s=instance_ttl_s, workers=workers, images=images)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        sweeper = asyncio.create_task(pool.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            await pool.close_all()

    app = FastAPI(title=f"agentrl environment server: {spec.name}", lifespan=lifespan)
    app.state.pool = pool
    id_field = fmt.id_field
    task = (int, ...) if fmt.task_required else (int, 0)
    StepBody = create_model("StepRequestBody", **{id_field: (int, ...), "action": (str, ...)})
    ResetBody = create_model("ResetRequestBody", **{id_field: (int, ...), fmt.task_field: task})
    CloseBody = create_model("CloseRequestBody", **{id_field: (int, ...)})

    class CreateBody(BaseModel):
        commands: str | None = None
        goal: str | None = None

    @app.get("/")
    async def banner() -> str:
        return fmt.banner

    @app.post("/create")
    async def create(body: CreateBody | None = None) -> Any:
        return await pool.create(body.commands if body else None, body.goal if body else None)

    @app.post("/reset")
    async def reset(body: ResetBody) -> Any:
        return await pool.reset(getattr(body, id_field), getattr(body, fmt.task_field))

    @app.post("/step")
    async def step(body: StepBody) -> Any:
        return await pool.step(getattr(body, id_field), body.action)

    @app.get("/observation")
    async def observation(instance: int = Query(alias=id_field)) -> Any:
        return await pool.observation(instance)

    @app.get("/detail")
    async def detail(instance: int = Query(alias=id_field)) -> Any:
        return await pool.detail(instance)

    @app.post("/close")
    async def close(body: CloseBody) -> bool:
        return await pool.close(getattr(body, id_field))

    @app.get("/instances")
    async def instances() -> dict[str, Any]:
        return {"ids": sorted(pool.instances), "count": len(pool.instances)}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "env": spec.name, "instances": len(pool.instances)}

    return app


def serve(name: str, host: str = "127.0.0.1", port: int = 8000, *,
          instance_ttl_s: float = DEFAULT_INSTANCE_TTL_S, images: bool = False) -> int:
    """Serve environment ``name`` until SIGINT/SIGTERM (or, under :data:`PARENT_FD_ENV`, until the starting
    process exits); prints :data:`READY_LINE` once listening. Returns the exit code."""
    import uvicorn

    from agentrl.envs.registry import get_spec

    try:
        spec = get_spec(name)
        app = create_app(spec, instance_ttl_s=instance_ttl_s, images=images)
    except (EnvError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        sock = listening_socket(host, port)
    except OSError as error:
        print(f"error: cannot listen on {host}:{port}: {error}", file=sys.stderr)
        return 1
    bound = sock.getsockname()[1]
    url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=75))
    parent_fd = os.environ.get(PARENT_FD_ENV)
    if parent_fd:
        threading.Thread(target=_exit_with_parent, args=(int(parent_fd), server), daemon=True,
                         name="parent-watch").start()
    print(READY_LINE.format(name=spec.name, url=url), flush=True)
    return 0 if serve_until_stopped(server, sock) else 1  # a stop's graceful shutdown closes every instance


def _exit_with_parent(fd: int, server: Any) -> None:
    """Block until the starting process's end of the pipe closes, then shut down (forcefully after 15 s)."""
    while os.read(fd, 1024):
        pass
    logger.info("the process that started this server stopped it or exited: shutting down")
    server.should_exit = True
    time.sleep(15)
    os._exit(1)
