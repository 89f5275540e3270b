"""``agentrl bench serve``: AutoRL-Bench's scenario API and grading API (docs/original.md) on one server.

Scenario API: ``GET /``, ``GET /scenarios``, ``GET /scenarios/{id}`` (404 naming the available ids),
``POST /evaluate {scenario_id, model_path}`` → ``{score, baseline, improvement, improvement_pct, details}`` (404 for an
unknown scenario or a missing model, 500 when the evaluation fails), ``POST /interact`` (interactive scenarios).
Errors are FastAPI's ``{"detail": ...}``, as AutoRL-Bench's scenario server.

Grading API (with ``--task``; errors are ``{"error": ...}`` as AutoRL-Bench's grading server): ``GET /health``, ``POST
/validate``, ``POST /submit {model_path?, async?}`` (blocking by default; ``"async": true`` returns ``{job_id}`` at
once, then ``GET /jobs/{id}``; 429 once ``max_evaluations`` gradings are used or queued), ``GET /best`` (404 before any
submission), ``GET /history``, ``POST /set_baseline {score}`` (JSON only; 400 without a score), ``GET /time``.

A server that grades a task records every evaluation it makes for others: ``/evaluate`` from anyone but the
operator grades the task's scenario only, on a model inside the workspace, as a submission (recorded, counted).
The **operator** is whoever presents the token of ``--admin_token_env`` (``Authorization: Bearer TOKEN``): only
they may ``/set_baseline`` and ``/evaluate`` any model unrecorded (the orchestrator's baseline); a server without a
token leaves ``/set_baseline`` open and makes unrecorded evaluations only while it grades no task. Cross-site
requests are refused (a browser's ``Origin`` or ``Sec-Fetch-Site`` naming another site), and so is a ``Host`` that
is not a loopback name while the server listens on loopback (DNS rebinding). Replies never name the database or
the server's files. Every call is appended to ``interactions.jsonl`` (``{timestamp, endpoint, method, request,
response, status, elapsed_seconds}``) in the state directory, next to the grading record.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from agentrl.autorl_bench.evaluation import EvaluationResult, Evaluator
from agentrl.autorl_bench.grading import GradingRequestError, GradingRun, GradingStateError, now_iso
from agentrl.autorl_bench.interact import InteractError, InteractSessions, training_indices
from agentrl.autorl_bench.scenarios import Scenario, ScenarioError, ScenarioSet, bench_home

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


class BenchServerConfig(BaseModel):
    """Everything ``agentrl bench serve`` takes."""

    model_config = ConfigDict(extra="forbid")

    task: str | None = Field(None, description="scenario of the grading API (AutoRL-Bench's --task)")
    workspace: str | None = Field(None, description="the run's workspace (default: workspace/TASK)")
    output_dir: str | None = Field(None, description="default model path of /submit (default: WORKSPACE/output)")
    host: str = "127.0.0.1"
    port: int = 5000
    unix_socket: str | None = Field(None, description="also serve on this Unix socket (made 0600)")
    eval_limit: int | None = Field(None, ge=1, description="evaluate on the first N test tasks only")
    eval_timeout: float = Field(7200.0, gt=0, description="seconds an evaluation may run before it fails")
    max_evaluations: int | None = Field(None, ge=1, description="gradings the task's workspace may ask for")
    db_connection_string: str | None = None
    engine_args: str = ""
    inference_urls: list[str] = Field(default_factory=list)
    env_server: list[str] = Field(default_factory=list)
    scenario: list[str] = Field(default_factory=list, description="scenario YAML files")
    state_dir: str | None = Field(None, description="grading record, evaluation results and logs, outside the "
                                                    "workspace (default: under the bench cache)")
    admin_token_env: str | None = Field(None, description="environment variable holding the operator's token")


class EvaluateRequest(BaseModel):
    scenario_id: str
    model_path: str


class InteractRequest(BaseModel):
    scenario_id: str | None = None
    session_id: str | None = None
    action: str | None = None
    data_idx: int | None = None


def available_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g.strip() for g in visible.split(",") if g.strip()] if visible else []


def default_state_dir(task: str | None, workspace: Path) -> Path:
    """``<bench cache>/runs/TASK-<hash of the workspace>`` (one record per workspace), or ``evals/all``."""
    if task is None:
        return bench_home() / "evals" / "all"
    return bench_home() / "runs" / f"{task}-{hashlib.sha256(str(workspace).encode()).hexdigest()[:12]}"


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def foreign_request(request: Request, loopback_only: bool) -> str | None:
    """Why ``request`` comes from another site (a browser page's cross-site request, or DNS rebinding), else None."""
    host = request.headers.get("host", "")
    if loopback_only and host and not _is_loopback(urlsplit("//" + host).hostname or ""):
        return f"Host {host!r} is not this server (it listens on loopback only)"
    if request.method not in ("GET", "HEAD"):
        if request.headers.get("sec-fetch-site") in ("cross-site", "same-site"):
            return "cross-site requests are refused"
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != host:
            return f"requests from {origin} are refused"
    return None


class BenchService:
    """The server's state: scenarios, the evaluator, the grading run (with ``--task``), interactive sessions."""

    def __init__(self, config: BenchServerConfig, db_uri: str, admin_token: str | None = None):
        self.config = config
        self.admin_token = admin_token
        self.scenarios = ScenarioSet(config.scenario)
        self.grading: GradingRun | None = None
        workspace = Path(config.workspace or Path("workspace") / (config.task or "scenarios")).resolve()
        self.state_dir = Path(config.state_dir).resolve() if config.state_dir else default_state_dir(config.task,
                                                                                                   workspace)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.state_dir / "interactions.jsonl"
        self.evaluator = Evaluator(db_connection_string=db_uri, state_dir=self.state_dir, eval_limit=config.eval_limit,
                                   engine_args=config.engine_args, inference_urls=config.inference_urls,
                                   env_servers=config.env_server, timeout_s=config.eval_timeout)
        if config.task:
            scenario = self.scenarios.get(config.task)
            self.grading = GradingRun(scenario, workspace, self.evaluator, self.state_dir,
                                      Path(config.output_dir) if config.output_dir else None,
                                      max_evaluations=config.max_evaluations)
        self.sessions: dict[str, InteractSessions] = {}
        self.baselines: dict[str, float] = {}
        self._baseline_locks: dict[str, asyncio.Lock] = {}

    def authorized(self, request: Request) -> bool:
        """Whether ``request`` carries the operator's token."""
        if self.admin_token is None:
            return False
        offered = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(offered.encode(), self.admin_token.encode())

    def log_call(self, entry: dict[str, Any]) -> None:
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")

    async def scenario_baseline(self, scenario: Scenario) -> float | None:
        """The scenario's fixed baseline, else its base model's score (evaluated once, then reused)."""
        if scenario.baseline_score is not None:
            return scenario.baseline_score
        if self.grading is not None and self.grading.scenario.id == scenario.id and self.grading.baseline() is not None:
            return self.grading.baseline()
        lock = self._baseline_locks.setdefault(scenario.id, asyncio.Lock())
        async with lock:
            if scenario.id not in self.baselines:
                result = await self.evaluator.evaluate(scenario, scenario.base_model(), "baseline")
                if result.score is None:
                    raise RuntimeError(f"the baseline evaluation of {scenario.id} failed: {result.error} "
                                       f"({result.detail})")
                self.baselines[scenario.id] = result.score
        return self.baselines[scenario.id]

    def scenario_info(self, scenario: Scenario) -> dict[str, Any]:
        """``GET /scenarios/{id}``. While grading a task, the task's paths are the workspace's copies and other
        scenarios' paths are withheld."""
        baseline = scenario.baseline_score
        if baseline is None and self.grading is not None and self.grading.scenario.id == scenario.id:
            baseline = self.grading.baseline()
        info = scenario.public_info(baseline if baseline is not None else self.baselines.get(scenario.id))
        if self.grading is not None:
            workspace = self.grading.workspace
            mine = scenario.id == self.grading.scenario.id
            train = workspace / "data" / "train.jsonl"
            model = workspace / "models" / Path(scenario.base_model()).name
            info.update(train_data=str(train) if mine and train.is_file() else None,
                        base_model=str(model) if mine and model.exists() else None)
            info.update(train_data_path=info["train_data"], base_model_path=info["base_model"])
        return info

    def interact_sessions(self, scenario: Scenario) -> InteractSessions:
        if scenario.eval.env is None:
            raise InteractError(f"scenario {scenario.id!r} is {scenario.type}: it has no environment to interact with")
        if scenario.id not in self.sessions:
            self.sessions[scenario.id] = InteractSessions(
                scenario.eval.env, training_indices(scenario.train_data_path, scenario.eval.env))
        return self.sessions[scenario.id]


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as error:
        raise GradingRequestError(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise GradingRequestError("the request body must be a JSON object")
    return body


def create_app(config: BenchServerConfig, db_uri: str, admin_token: str | None = None) -> FastAPI:
    service = BenchService(config, db_uri, admin_token)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # FastAPI's signature
        yield
        # Stop what is still running: evaluations (their agentrl eval process groups are killed; each grading is
        # recorded as failed), environment sessions.
        service.evaluator.stop_all()
        if service.grading is not None:
            tasks = [job.task for job in service.grading.jobs.values() if job.task is not None and not job.task.done()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for sessions in service.sessions.values():
            sessions.close_all()

    app = FastAPI(title="AutoRL-Bench (AgentRL)", version=VERSION, lifespan=lifespan)
    app.state.service = service
    _add_middleware(app, service)
    _add_scenario_api(app, service)
    _add_grading_api(app, service)
    return app


def _add_middleware(app: FastAPI, service: BenchService) -> None:
    """Refusal of foreign requests, the interaction log, and the grading API's error replies."""
    loopback_only = _is_loopback(service.config.host)

    @app.middleware("http")
    async def refuse_foreign(request: Request, call_next):  # FastAPI's signature
        reason = foreign_request(request, loopback_only)
        if reason is not None:
            return _error(403, reason)
        return await call_next(request)

    @app.middleware("http")  # added last, so it runs first: refused requests are recorded too
    async def record_interaction(request: Request, call_next):  # FastAPI's signature
        started = time.perf_counter()
        body = await request.body()
        response = await call_next(request)
        chunks = [chunk async for chunk in response.body_iterator]
        content = b"".join(chunks)
        try:
            request_data: Any = json.loads(body) if body.strip() else dict(request.query_params)
        except json.JSONDecodeError:
            request_data = body.decode("utf-8", "replace")
        try:
            response_data: Any = json.loads(content) if content else None
        except json.JSONDecodeError:
            response_data = content.decode("utf-8", "replace")
        service.log_call({"timestamp": now_iso(), "endpoint": request.url.path, "method": request.method,
                          "request": request_data, "response": response_data, "status": response.status_code,
                          "elapsed_seconds": round(time.perf_counter() - started, 4)})
        return Response(content=content, status_code=response.status_code, headers=dict(response.headers),
                        media_type=response.media_type)

    @app.exception_handler(GradingRequestError)
    async def refused(_: Request, error: GradingRequestError) -> JSONResponse:
        return _error(error.status, str(error), **error.extra)


def _evaluate_reply(result: EvaluationResult, baseline: float | None, **details: Any) -> Any:
    """``POST /evaluate``'s reply (AutoRL-Bench's fields)."""
    if result.score is None:
        return JSONResponse({"detail": result.error, **details}, status_code=500)
    improvement = None if baseline is None else round(result.score - baseline, 4)
    pct = None if not baseline or improvement is None else f"{100.0 * improvement / baseline:+.2f}%"
    return {"score": result.score, "baseline": baseline, "improvement": improvement, "improvement_pct": pct,
            "details": {**result.metrics, "reused": result.reused, "elapsed_seconds": result.elapsed_seconds,
                        **details}}


def _add_scenario_api(app: FastAPI, service: BenchService) -> None:
    """Seed 000's endpoints."""
    config = service.config

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"name": "AutoRL-Bench", "implementation": "AgentRL", "version": VERSION,
                "endpoints": sorted({route.path for route in app.routes if hasattr(route, "methods")}),
                "scenarios": service.scenarios.ids(), "task": config.task}

    @app.get("/scenarios")
    async def scenarios() -> dict[str, Any]:
        rows = []
        for scenario_id in service.scenarios.ids():
            rows.append(await asyncio.to_thread(service.scenarios.get, scenario_id))
        return {"scenarios": [s.summary() for s in rows]}

    @app.get("/scenarios/{scenario_id}")
    async def scenario_detail(scenario_id: str) -> Any:
        try:
            scenario = await asyncio.to_thread(service.scenarios.get, scenario_id)
        except ScenarioError as error:
            return JSONResponse({"detail": str(error), "available": service.scenarios.ids()}, status_code=404)
        return service.scenario_info(scenario)

    @app.post("/evaluate")
    async def evaluate(body: EvaluateRequest, request: Request) -> Any:
        operator = service.authorized(request) or (service.admin_token is None and service.grading is None)
        if not operator and service.grading is None:
            return JSONResponse({"detail": "/evaluate needs the operator's token"}, status_code=403)
        if not operator:  # a graded task's workspace: a recorded submission of the task
            run = service.grading
            if body.scenario_id != run.scenario.id:
                return JSONResponse({"detail": f"this server grades {run.scenario.id!r} only"}, status_code=403)
            result = await (await run.enqueue(body.model_path, via="evaluate")).task
            graded = EvaluationResult(score=None if result.get("error") else result["score"],
                                      metrics=result["metrics"], error=result.get("error"),
                                      elapsed_seconds=result["elapsed_seconds"],
                                      reused=result["metrics"].get("reused", False))
            return _evaluate_reply(graded, result["baseline_score"], submission_id=result["submission_id"])
        try:
            scenario = await asyncio.to_thread(service.scenarios.get, body.scenario_id)
        except ScenarioError as error:
            return JSONResponse({"detail": str(error), "available": service.scenarios.ids()}, status_code=404)
        if not Path(body.model_path).exists():
            return JSONResponse({"detail": f"model not found: {body.model_path}"}, status_code=404)
        try:
            baseline = await service.scenario_baseline(scenario)
        except RuntimeError as error:
            return JSONResponse({"detail": str(error)}, status_code=500)
        result = await service.evaluator.evaluate(scenario, body.model_path, "evaluate")
        if result.error and result.detail:
            result.error = f"{result.error} ({result.detail})"
        return _evaluate_reply(result, baseline)

    @app.post("/interact")
    async def interact(body: InteractRequest) -> Any:
        scenario_id = body.scenario_id or config.task
        if scenario_id is None:
            return JSONResponse({"detail": "'scenario_id' is required"}, status_code=400)
        try:
            scenario = await asyncio.to_thread(service.scenarios.get, scenario_id)
            sessions = await asyncio.to_thread(service.interact_sessions, scenario)
            return await sessions.interact(body.session_id, body.action, body.data_idx)
        except ScenarioError as error:
            return JSONResponse({"detail": str(error), "available": service.scenarios.ids()}, status_code=404)
        except InteractError as error:
            return JSONResponse({"detail": str(error)}, status_code=400)


def _add_grading_api(app: FastAPI, service: BenchService) -> None:
    """Seed 001's endpoints (with ``--task``)."""
    config = service.config

    def grading() -> GradingRun:
        if service.grading is None:
            raise GradingRequestError("this server grades no task: start it with `agentrl bench serve --task TASK`",
                                      status=404)
        return service.grading

    @app.get("/health")
    async def health() -> Any:
        run = service.grading
        return {"status": "ok", "task": config.task, "workspace": str(run.workspace) if run else None,
                "available_gpus": available_gpus(), "pending_evaluations": run.pending() if run else 0,
                "max_evaluations": run.max_evaluations if run else None,
                "evaluations_left": run.evaluations_left() if run else None}

    @app.post("/validate")
    async def validate(request: Request) -> Any:
        return grading().validate((await _json_body(request)).get("model_path"))

    @app.post("/submit")
    async def submit(request: Request) -> Any:
        run, body = grading(), await _json_body(request)
        gpu = body.get("gpu")
        if gpu is not None:
            wanted = [str(g) for g in (gpu if isinstance(gpu, list) else str(gpu).split(","))]
            if not set(wanted) <= set(available_gpus()):
                raise GradingRequestError(f"gpu {gpu!r} is not among the available GPUs",
                                          available_gpus=available_gpus())
        job = await run.enqueue(body.get("model_path"))
        if body.get("async"):
            return JSONResponse(job.public(), status_code=202)
        return await job.task

    @app.get("/jobs/{job_id}")
    async def job_status(job_id: str) -> Any:
        job = grading().jobs.get(job_id)
        if job is None:
            raise GradingRequestError(f"no job {job_id}", status=404)
        return job.public()

    @app.get("/best")
    async def best() -> Any:
        run = grading()
        entry = run.best()
        if entry is None:
            raise GradingRequestError("No submissions", status=404)
        return {"best": entry, "total_submissions": len(run.history())}

    @app.get("/history")
    async def history() -> Any:
        return grading().history()

    @app.post("/set_baseline")
    async def set_baseline(request: Request) -> Any:
        run = grading()
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise GradingRequestError("/set_baseline takes a JSON body (Content-Type: application/json)", status=415)
        if service.admin_token is not None and not service.authorized(request):
            raise GradingRequestError("/set_baseline needs the operator's token", status=403)
        return {"baseline_score": run.set_baseline((await _json_body(request)).get("score")), "status": "set"}

    @app.get("/time")
    async def time_left() -> Any:
        return grading().time_info()


READY_LINE = "agentrl bench: serving at {url}"


def serve(config: BenchServerConfig) -> int:
    """Serve until SIGINT/SIGTERM; prints :data:`READY_LINE` once listening. Returns the exit code."""
    import sys

    import uvicorn

    from agentrl.listen import listening_socket, serve_until_stopped, unix_listening_socket
    from agentrl.store import resolve_connection_string

    token = None
    if config.admin_token_env:
        token = os.environ.get(config.admin_token_env, "")
        if not token:
            print(f"agentrl bench serve: error: --admin_token_env {config.admin_token_env}: the environment "
                  "variable is unset or empty", file=sys.stderr)
            return 2
    try:
        db_uri = resolve_connection_string(config.db_connection_string, database="autorl-bench")
        app = create_app(config, db_uri, token)
    except (ScenarioError, GradingStateError, ValueError, OSError) as error:
        print(f"agentrl bench serve: error: {error}", file=sys.stderr)
        return 2
    try:
        sockets = [listening_socket(config.host, config.port)]
        if config.unix_socket:
            sockets.append(unix_listening_socket(config.unix_socket))
    except OSError as error:
        print(f"agentrl bench serve: error: cannot listen: {error}", file=sys.stderr)
        return 1
    bound = sockets[0].getsockname()[1]
    url = f"http://[{config.host}]:{bound}" if ":" in config.host else f"http://{config.host}:{bound}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    print(READY_LINE.format(url=url), flush=True)
    try:
        return 0 if serve_until_stopped(server, *sockets) else 1
    finally:
        if config.unix_socket:
            with contextlib.suppress(OSError):
                os.unlink(config.unix_socket)
