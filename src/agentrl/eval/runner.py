"""Evaluate a model on a task file or split, reusing the rollout machinery: Tasks, leases, Sampler, scorers.

An evaluation job is:

1. **tasks** — parse and validate the task file (or read the Tasks of an existing split) *before anything is
   written*; a bad file fails with every problem as ``FILE:LINE``;
2. **model** — a model directory (an ``agentrl engine`` is started on it, unregistered, and stopped afterwards),
   or live services (``--inference_urls``, SGLang or ``agentrl engine``) used directly;
3. **reuse key** — a hash of the model identity (directory path + size and mtime of its weight/config files, or
   the services' ``model_path`` and ``weight_version``), the tasks' content, the sampling and rollout parameters,
   k, repeats, seed (greedy decoding ignores it), the tool and scorer configuration. A ``completed`` ``Eval``
   document with that key is reused unless ``force``;
4. **sampling** — the tasks are inserted into the job's own split (``eval:<key12>``) with ``num_generations =
   k × repeats``, and an in-process :class:`~agentrl.rollout.sampler.Sampler` with ``exit_when_done`` rolls them
   out and scores them exactly as training samplers do (non-train splits skip the training decisions of the
   group stage). Requests go only to the evaluated model's services (:mod:`agentrl.eval.inference`). Several
   processes running the same job share the work through the split's leases; an interrupted job resumes;
5. **metrics** — computed from the split's Records (:mod:`agentrl.eval.metrics`) and stored in the ``Eval``
   document (overall, per task type, per task).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import shlex
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pymongo.errors import BulkWriteError

from agentrl.config_flags import NO_FLAG, Flag, comma_list
from agentrl.eval.metrics import (
    ENV_ERROR,
    ENV_START_ERROR,
    FAILED_ERROR,
    MISSING,
    SCORE_ERROR,
    SLOT_FAILED,
    UNTYPED,
    Sample,
    TaskSamples,
    per_task_rows,
    summarize,
    summarize_by_type,
)
from agentrl.log import redact
from agentrl.rollout.config import ConcurrencyConfig, RolloutConfig, SamplerConfig, ToolsConfig
from agentrl.scoring.answers import ANSWER_SCHEMAS
from agentrl.store import Record, RecordStatus, Store, Task, resolve_connection_string
from agentrl.store.connection import DB_HELP
from agentrl.store.evals import Eval, EvalStatus
from agentrl.store.models import OPEN_TASK_STATES
from agentrl.store.task_files import TaskFileError, UploadDefaults, parse_file
from agentrl.vision.images import LoadedImage

logger = logging.getLogger(__name__)

KEY_VERSION = 1
MAX_PER_TASK_ROWS = 5000
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".json", ".jinja", ".model", ".txt")
_SCORED = {str(RecordStatus.SCORED), str(RecordStatus.READY), str(RecordStatus.TRAINED), str(RecordStatus.ABANDONED)}
_PLACEHOLDER_SPLIT = "eval"
class EvalError(RuntimeError):
    """The evaluation cannot run (bad configuration, unreachable service, engine that does not start)."""


class EvalInterrupted(RuntimeError):
    """The evaluation was stopped (SIGINT/SIGTERM) before every sample was done; a rerun resumes it."""


class EvalRolloutConfig(RolloutConfig):
    """The rollout of an evaluation: greedy decoding and a fixed seed unless asked otherwise."""

    temperature: float = Field(0.0, ge=0.0, description="sampling temperature; 0: greedy")
    seed: int | None = Field(0, description=RolloutConfig.model_fields["seed"].description)


class EvalConcurrencyConfig(ConcurrencyConfig):
    """The concurrency of an evaluation (an in-process sampler)."""

    max_concurrent_samples_per_process: int = Field(
        16, ge=1, description=ConcurrencyConfig.model_fields["max_concurrent_samples_per_process"].description)


class EvalConfig(BaseModel):
    """Everything ``agentrl eval`` needs; each field (and each field of a nested model) is one of its flags. The
    rollout, tools and concurrency are ``agentrl sample``'s models (its flag names, the original AgentRL's)."""

    model_config = ConfigDict(extra="forbid")

    db_connection_string: Annotated[str | None, Flag(metavar="URI")] = Field(None, description=DB_HELP)
    tasks: Annotated[str | None, Flag(metavar="FILE")] = Field(
        None, description="task file, JSON or JSONL (as for `agentrl tasks upload`)")
    split: str | None = Field(None, description="evaluate the Tasks already stored under this split instead")
    limit: Annotated[int | None, Flag(metavar="N")] = Field(None, ge=1, description="only the first N tasks")
    scorer: str = Field("agentcpm", description="scorer of tasks that name none")
    answer_schema: str = Field(
        "answer", description=f"answer marker of tasks that name none: one of {', '.join(ANSWER_SCHEMAS)}")
    model_name_or_path: str | None = Field(
        None, description="model directory to evaluate: an agentrl engine is started on it and stopped afterwards "
        "(default: the embedded SmolLM2 model); with --inference_urls only its tokenizer")
    inference_urls: Annotated[list[str], Flag(parse=comma_list, unparse=",".join, metavar="URLS")] = Field(
        default_factory=list, description="comma-separated URLs of live SGLang / agentrl engine services serving "
        "the model (used directly, never registered in the run)")
    engine_args: Annotated[list[str], Flag(parse=shlex.split, unparse=shlex.join, metavar="ARGS")] = Field(
        default_factory=list, description="extra `agentrl engine` flags, e.g. '--device cuda --dtype bfloat16'")
    name: str | None = Field(None, description="label of this evaluation (default: model and task names)")
    num_samples_per_task: Annotated[int, Flag(aliases=("-k",))] = Field(1, ge=1, description="samples per task, k")
    repeats: int = Field(1, ge=1, description="repeat the k samples R times: pass@k uses all k × R samples, and the "
                         "spread over repeats is reported")
    rollout: EvalRolloutConfig = Field(default_factory=EvalRolloutConfig, title="sampling and rollout")
    max_attempts: int = Field(3, ge=1, description="attempts per sample slot before it is an error")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, title="tools and scorers")
    concurrency: EvalConcurrencyConfig = Field(default_factory=EvalConcurrencyConfig, title="concurrency")
    engine_startup_timeout_s: Annotated[float, NO_FLAG] = 600.0
    force: bool = Field(False, description="recompute even if a stored result matches")

    @field_validator("answer_schema")
    @classmethod
    def _known_answer_schema(cls, schema: str) -> str:
        if schema not in ANSWER_SCHEMAS:
            raise ValueError(f"expected one of {', '.join(ANSWER_SCHEMAS)}, got {schema!r}")
        return schema


@dataclass
class EvalOutcome:
    job: Eval
    reused: bool
    database: str


# ------------------------------------------------------------------------------------------------------- tasks


def task_suffix(task: Task) -> str:
    """The task's id without its split prefix (stable across splits)."""
    return task.id.removeprefix(f"{task.split}:")


def task_type_of(task: Task) -> str:
    value = task.task_type or task.metadata.get("type") or task.metadata.get("task_type")
    return str(value) if value else UNTYPED


def load_task_file(cfg: EvalConfig) -> tuple[list[Task], list[LoadedImage]]:
    """Parse and validate the whole task file (raises :class:`TaskFileError` listing ``FILE:LINE`` problems): its
    Tasks (the first ``--limit``) and the images they refer to."""
    defaults = UploadDefaults(split=_PLACEHOLDER_SPLIT, num_generations=1, scorer=cfg.scorer,
                              answer_schema=cfg.answer_schema, max_attempts=cfg.max_attempts)
    parsed = parse_file(cfg.tasks, defaults)
    if parsed.problems:
        raise TaskFileError(parsed.problems)
    tasks = [task for _, task in parsed.tasks]
    tasks = tasks[: cfg.limit] if cfg.limit else tasks
    wanted = {sha256 for task in tasks for sha256 in task.images}
    return tasks, [image for sha256, image in parsed.images.items() if sha256 in wanted]


async def load_split_tasks(store: Store, split: str, limit: int | None) -> list[Task]:
    cursor = store.db[Task.collection].find({"split": split}, sort=[("order", 1), ("_id", 1)], limit=limit or 0)
    tasks = [Task.from_mongo(doc) async for doc in cursor]
    if not tasks:
        raise EvalError(f"the split {split!r} has no Tasks (upload them with `agentrl tasks upload FILE --split "
                        f"{split}`, or pass --tasks FILE)")
    return tasks


def tasks_digest(tasks: list[Task]) -> str:
    rows = sorted([task_suffix(t), t.content_hash, t.scorer, t.answer_schema, t.task_type, t.metadata]
                  for t in tasks)
    return _digest(rows)


async def insert_tasks(store: Store, tasks: list[Task], split: str, generations: int, max_attempts: int) -> int:
    """Insert fresh copies of ``tasks`` into ``split`` (skipping those already there); returns how many."""
    collection = store.db[Task.collection]
    base = time.time_ns()
    fresh = [Task(id=f"{split}:{task_suffix(t)}", split=split, order=base + i, query=t.query, answer=t.answer,
                  system_prompt=t.system_prompt, images=t.images, scorer=t.scorer, answer_schema=t.answer_schema,
                  task_type=t.task_type, metadata=t.metadata, content_hash=t.content_hash,
                  num_generations=generations, max_attempts=max_attempts, unclaimed=generations,
                  remaining=generations)
             for i, t in enumerate(tasks)]
    existing = {doc["_id"] async for doc in collection.find({"split": split}, {"_id": 1})}
    new = [t.to_mongo() for t in fresh if t.id not in existing]
    if new:
        try:
            await collection.insert_many(new, ordered=False)
        except BulkWriteError as error:  # another process of the same job inserted some meanwhile
            if any(e.get("code") != 11000 for e in error.details.get("writeErrors", [])):
                raise
    return len(new)


# ------------------------------------------------------------------------------------------------------ model


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def file_digest(path: str | None) -> str | None:
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        raise EvalError(f"{path}: no such file")
    return hashlib.sha256(file.read_bytes()).hexdigest()


def model_dir_identity(path: Path) -> dict[str, Any]:
    """A model directory's identity: its absolute path and the size and mtime of its weight/config files."""
    path = path.expanduser().resolve()
    files = sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in path.iterdir()
                   if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES)
    return {"path": str(path), "files": files}


async def service_identity(urls: list[str]) -> tuple[dict[str, Any], str]:
    """``(identity, tokenizer hint)`` of live services: the model path and weight version they report."""
    from agentrl.inference.client import SGLangClient

    infos = []
    for url in urls:
        async with SGLangClient(url, timeout_s=30.0, max_retries=1) as client:
            try:
                infos.append(await client.get_model_info())
            except Exception as error:  # any failure means the service cannot be evaluated
                raise EvalError(f"cannot reach the inference service {redact(url)}: {redact(str(error))}") from error
    served = {(i.model_path, i.weight_version) for i in infos}
    if len(served) > 1:
        served_by = (f"{u} → {i.model_path} (weights {i.weight_version})" for u, i in zip(urls, infos))
        raise EvalError("the inference services serve different models or weight versions: " + ", ".join(served_by))
    info = infos[0]
    identity = {"model_path": info.model_path, "weight_version": info.weight_version}
    return identity, info.tokenizer_path or info.model_path


def _tokenizer_identity(name: str) -> str:
    local = Path(name).expanduser()
    return str(local.resolve()) if local.exists() else name


# -------------------------------------------------------------------------------------------------- records


def classify(record: dict[str, Any] | None, slot: int) -> Sample:
    """One slot's latest Record as a metric sample (valid with its score, or an error kind)."""
    if record is None:
        return Sample(slot, error=MISSING)
    outcome, turns = record.get("outcome"), int(record.get("num_turns") or 0)
    if record.get("score_error"):
        return Sample(slot, error=SCORE_ERROR, outcome=outcome, num_turns=turns)
    if record.get("status") in _SCORED and record.get("score") is not None:
        if outcome in (FAILED_ERROR, ENV_START_ERROR, ENV_ERROR):  # inference or environment failed: no verdict
            return Sample(slot, error=outcome, outcome=outcome, num_turns=turns)
        details = record.get("score_details") or {}
        episode = "success" in details and "data_idx" in details  # an environment episode (rollout.episode)
        return Sample(slot, score=float(record["score"]), outcome=outcome, num_turns=turns,
                      success=bool(details["success"]) if episode else None,
                      env_reward=float(details["reward"]) if episode else None)
    return Sample(slot, error=SLOT_FAILED, outcome=outcome, num_turns=turns)


async def collect_samples(store: Store, split: str) -> list[TaskSamples]:
    """Every task of ``split`` with the latest attempt of each of its slots."""
    tasks = [Task.from_mongo(doc) async for doc in
             store.db[Task.collection].find({"split": split}, sort=[("order", 1), ("_id", 1)])]
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    fields = {"task_id": 1, "slot": 1, "attempt": 1, "status": 1, "score": 1, "score_error": 1, "outcome": 1,
              "num_turns": 1, "score_details": 1}
    async for record in store.db[Record.collection].find({"split": split}, fields):
        key = (record["task_id"], record["slot"])
        if key not in latest or record["attempt"] > latest[key]["attempt"]:
            latest[key] = record
    return [TaskSamples(task_suffix(task), task_type_of(task),
                        [classify(latest.get((task.id, slot)), slot) for slot in range(task.num_generations)])
            for task in tasks]


async def open_tasks(store: Store, split: str) -> int:
    return await store.db[Task.collection].count_documents({"split": split, "status": {"$in": list(OPEN_TASK_STATES)}})


# ------------------------------------------------------------------------------------------------------- job


def _sampling(cfg: EvalConfig) -> dict[str, Any]:
    """The sampling and rollout parameters in the reuse key (penalties and min_p only when set)."""
    r = cfg.rollout
    optional = {k: v for k, v in (("min_p", r.min_p), ("presence_penalty", r.presence_penalty),
                                  ("frequency_penalty", r.frequency_penalty)) if v}
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, **optional,
            "max_new_tokens": r.max_new_tokens, "max_turns": r.max_turns,
            "max_prompt_tokens": r.max_prompt_tokens, "query_prompt": r.query_prompt,
            "new_context": r.new_context, "repetition_early_stop_times": r.repetition_early_stop_times,
            "tool_call_parser": r.tool_call_parser, "tool_timeout": r.tool_timeout}


def _default_name(model: dict[str, Any], source: str) -> str:
    model_name = Path(str(model.get("path") or model.get("model_path") or "model")).name
    return f"{model_name} on {Path(source).stem if source.startswith('file:') else source}"


def _sampler_config(cfg: EvalConfig, uri: str, split: str, tokenizer: str | None) -> SamplerConfig:
    """The in-process sampler of the job: the evaluation's rollout, tools and concurrency on the job's split."""
    return SamplerConfig(db_connection_string=uri, model_name_or_path=tokenizer, split=split,
                         sampler_id=f"eval:{socket.gethostname()}:{os.getpid()}", rollout=cfg.rollout,
                         tools=cfg.tools, concurrency=cfg.concurrency, exit_when_done=True)


async def evaluate(cfg: EvalConfig) -> EvalOutcome:
    """Run (or reuse) the evaluation described by ``cfg``; see the module docstring."""
    if bool(cfg.tasks) == bool(cfg.split):
        raise EvalError("give exactly one of --tasks FILE and --split NAME")
    tasks, images = load_task_file(cfg) if cfg.tasks else (None, [])  # validated before anything is started/written
    agent_digest = file_digest(cfg.tools.agent_config_path)
    mcp_digest = file_digest(cfg.tools.mcp_config)
    module_digests = [file_digest(m) for m in cfg.tools.scorer_module]

    if cfg.inference_urls:
        model, hint = await service_identity(cfg.inference_urls)
        tokenizer = cfg.model_name_or_path or hint
        model_dir = None
    else:
        if cfg.model_name_or_path:
            model_dir = Path(cfg.model_name_or_path)
            if not model_dir.is_dir():
                raise EvalError(f"--model_name_or_path {cfg.model_name_or_path}: not a model directory (give a "
                                "local Hugging Face directory, or serve the model and pass --inference_urls)")
        else:
            from agentrl.inference.embedded_model import default_model_path

            model_dir = default_model_path()
        model = model_dir_identity(model_dir)
        tokenizer = str(model_dir)

    uri = resolve_connection_string(cfg.db_connection_string)
    async with Store(uri, lease_s=cfg.concurrency.lease_s) as store:
        if tasks is None:
            tasks = await load_split_tasks(store, cfg.split, cfg.limit)
        source = f"file:{cfg.tasks}" if cfg.tasks else f"split:{cfg.split}"
        inputs = {
            "version": KEY_VERSION, "model": model, "tokenizer": _tokenizer_identity(tokenizer),
            "tasks": tasks_digest(tasks), "num_tasks": len(tasks), "k": cfg.num_samples_per_task,
            "repeats": cfg.repeats, "seed": cfg.rollout.seed if cfg.rollout.temperature > 0 else None,
            "sampling": _sampling(cfg),
            "tools": {"mcp_config": mcp_digest, "mcp_manager_url": cfg.tools.mcp_manager_url,
                      "mcp_server_name": cfg.tools.mcp_server_name},
            "scoring": {"agent_config": agent_digest, "scorer_modules": module_digests},
        }
        key = _digest(inputs)[:32]
        fields = {"name": cfg.name or _default_name(model, source), "key_inputs": inputs, "model": model,
                  "tasks_source": source, "num_tasks": len(tasks), "num_samples_per_task": cfg.num_samples_per_task,
                  "repeats": cfg.repeats, "seed": cfg.rollout.seed, "sampling": _sampling(cfg)}
        job = await store.evals.start(key, fields, force=cfg.force)
        if job.status == EvalStatus.COMPLETED:
            logger.info("reusing the stored result of evaluation %s (%s)", key, job.finished_at)
            return EvalOutcome(job, reused=True, database=store.db.name)
        generations = cfg.num_samples_per_task * cfg.repeats
        for image in images:  # before the Tasks that refer to them (a split's are in this database already)
            await store.images.put(image)
        inserted = await insert_tasks(store, tasks, job.split, generations, cfg.max_attempts)
        logger.info("evaluation %s: %d tasks × %d samples on split %s (%d tasks inserted)", key, len(tasks),
                    generations, job.split, inserted)
        try:
            stats = await _sample(cfg, uri, job.split, model_dir, tokenizer)
            if await open_tasks(store, job.split):
                raise EvalInterrupted(f"evaluation {key} stopped before it was done; run the same command again "
                                      "to resume it")
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(store.evals.interrupt(job))
            raise
        per_task = await collect_samples(store, job.split)
        k, repeats = cfg.num_samples_per_task, cfg.repeats
        finished = await store.evals.finish(
            job, metrics=summarize(per_task, k, repeats), by_type=summarize_by_type(per_task, k, repeats),
            per_task=per_task_rows(per_task) if len(per_task) <= MAX_PER_TASK_ROWS else [], stats=stats)
        return EvalOutcome(finished, reused=False, database=store.db.name)


async def _sample(cfg: EvalConfig, uri: str, split: str, model_dir: Path | None, tokenizer: str | None
                  ) -> dict[str, Any]:
    """Roll out every open slot of ``split`` (starting and stopping an engine when no URL is given)."""
    from agentrl.eval.inference import DirectInferencePool
    from agentrl.rollout.process import sampler_resources
    from agentrl.rollout.sampler import Sampler, SamplerHalted

    engine: concurrent.futures.Future | None = None
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    loop.add_signal_handler(signal.SIGTERM, current.cancel)  # stop the engine we start, even on SIGTERM
    try:
        urls = list(cfg.inference_urls)
        if not urls:
            logger.info("starting an agentrl engine on %s", model_dir)
            engine = _spawn_engine(model_dir, cfg)
        config = _sampler_config(cfg, uri, split, tokenizer)
        async with sampler_resources(config) as resources:  # tokenizer and tools start while the engine loads
            if engine is not None:
                urls = [await _engine_url(engine)]
            resources.inference = DirectInferencePool(urls, target_concurrency=cfg.concurrency.target_concurrency,
                                                      timeout_s=cfg.concurrency.request_timeout)
            try:
                sampler = Sampler(resources)
                sampler.install_signal_handlers()
                stats = await sampler.run()
            except SamplerHalted as error:
                raise EvalError(str(error)) from error
            finally:
                loop.add_signal_handler(signal.SIGTERM, current.cancel)
                loop.add_signal_handler(signal.SIGINT, current.cancel)
                await resources.inference.close()
        return {"trajectories": stats.trajectories, "scored": stats.scored, "score_errors": stats.score_errors,
                "lost_leases": stats.lost_leases, "outcomes": stats.outcomes, "inference_urls": urls}
    finally:
        if engine is not None:
            _stop_engine(engine)
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)


def _spawn_engine(model_dir: Path | None, cfg: EvalConfig) -> concurrent.futures.Future:
    """Start an unregistered ``agentrl engine`` in a thread (it blocks until the engine serves)."""
    from agentrl.inference.process import EngineProcess

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-start")
    started = executor.submit(EngineProcess, model_dir, "--no_register", *cfg.engine_args,
                              startup_timeout_s=cfg.engine_startup_timeout_s)
    executor.shutdown(wait=False)
    return started


async def _engine_url(started: concurrent.futures.Future) -> str:
    from agentrl.inference.process import EngineStartError

    try:
        engine = await asyncio.wrap_future(started)
    except EngineStartError as error:
        raise EvalError(str(error)) from error
    logger.info("engine %s serving at %s", engine.pid, engine.url)
    return engine.url


def _stop_engine(started: concurrent.futures.Future) -> None:
    """Stop the engine now, or as soon as it is up if it is still starting: no engine outlives the evaluation."""
    started.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and f.result().stop())
