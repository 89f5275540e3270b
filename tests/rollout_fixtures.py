"""Rollout fixtures: the scripted tiny model (real tool calls), an engine serving it, and helpers that run the
real ``agentrl sample`` / ``agentrl tasks upload`` commands against a test database.

Registered as a plugin by ``conftest.py``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock
from pymongo import MongoClient

from inference_fixtures import TEST_ENV, start_engine
from scripted_model import SCRIPTS, build_scripted_model, calculator_config

SCRIPTED_STEPS = 150


def cached_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, name: str,
                     source: bytes, build: Callable[[Path], Path]) -> Path:
    """A model built by ``build(scratch_dir)``, kept in pytest's cache under ``name`` per ``source`` (the code that
    defines it) and the torch/transformers versions, so a second pytest run (the SecantusDB pass of
    ``scripts/test.sh``) reuses it. Tests never write into it."""
    import torch
    import transformers

    key = hashlib.sha256(source + f"{torch.__version__}/{transformers.__version__}".encode())
    cached = Path(request.config.cache.mkdir(name)) / key.hexdigest()[:16]
    with FileLock(f"{cached}.lock"):  # parallel workers (pytest -n) wait for the one that builds it
        if (cached / "config.json").exists():
            return cached
        built = build(tmp_path_factory.mktemp(name))
        staging = cached.with_name(cached.name + f".{os.getpid()}.tmp")
        shutil.copytree(built, staging)
        staging.rename(cached)  # complete before anyone sees the name
    return cached


@pytest.fixture(scope="session")
def scripted_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained on ``scripted_model.SCRIPTS`` (about a minute on one core)."""
    source = (Path(__file__).parent / "scripted_model.py").read_bytes() + f"{SCRIPTED_STEPS}".encode()
    return cached_model_dir(request, tmp_path_factory, "scripted-model", source,
                            lambda scratch: build_scripted_model(scratch, steps=SCRIPTED_STEPS))


@pytest.fixture(scope="session")
def everything_server_entry(request: pytest.FixtureRequest) -> Path:
    """The MCP project's reference server (``@modelcontextprotocol/server-everything``, pinned), installed with npm
    into pytest's cache once; the test skips where npm or its registry is not available."""
    from tools_fixtures import EVERYTHING_PACKAGE, install_everything_server

    directory = Path(request.config.cache.mkdir("server-everything"))
    with FileLock(f"{directory}.lock"):
        entry = install_everything_server(directory)
    if entry is None:
        pytest.skip(f"npm could not install {EVERYTHING_PACKAGE} (needs node, npm and the npm registry)")
    return entry


@pytest.fixture(scope="session")
def scripted_vision_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                              everything_server_entry: Path) -> Path:
    """The tiny Qwen2.5-VL trained on ``scripted_vision_model``'s script (about half a minute on one core)."""
    from scripted_vision_model import build_scripted_vision_model

    source = (Path(__file__).parent / "scripted_vision_model.py").read_bytes()
    return cached_model_dir(request, tmp_path_factory, "scripted-vision-model", source,
                            lambda scratch: build_scripted_vision_model(scratch, everything_server_entry))


@pytest.fixture(scope="session")
def babyai_vision_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL that answers BabyAI's pictures with ``Action: turn left`` (``scripted_vision_model``)."""
    from scripted_vision_model import build_babyai_vision_model

    source = (Path(__file__).parent / "scripted_vision_model.py").read_bytes()
    return cached_model_dir(request, tmp_path_factory, "babyai-vision-model", source, build_babyai_vision_model)


@pytest.fixture(scope="session")
def scripted_engine_url(scripted_model_dir: Path) -> Iterator[str]:
    """An unregistered engine serving the scripted model; samplers get it with ``--inference_urls``."""
    engine = start_engine(scripted_model_dir)
    try:
        yield engine.url
    finally:
        engine.stop()


def write_mcp_config(path: Path, servers: list[dict] | None = None) -> Path:
    """An MCP config file with the built-in calculator over stdio (or ``servers``)."""
    config = servers or [s.model_dump(exclude_none=True) for s in calculator_config().servers]
    path.write_text(json.dumps({"servers": config}))
    return path


def write_script_tasks(path: Path, ids: tuple[str, ...] | None = None) -> Path:
    rows = [{"id": s.task_id, "question": s.question, "answer": s.answer} for s in SCRIPTS
            if ids is None or s.task_id in ids]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def agentrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli.main", *args]


def run_env() -> dict[str, str]:
    return {**os.environ, **TEST_ENV}


def upload(db_uri: str, tasks_file: Path, *args: str) -> None:
    """``agentrl tasks upload`` in this process (the command's own tests, ``test_cli_tasks.py``, start processes),
    on a thread of its own: it runs its own event loop, and some callers are inside one."""
    from agentrl.cli.main import main

    argv = ["tasks", "upload", str(tasks_file), "--db_connection_string", db_uri, "--scorer", "math",
            "--answer_schema", "boxed", *args]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(main, argv).result(timeout=120) == 0, f"agentrl {' '.join(argv)} failed (see the log)"


def sample_args(db_uri: str, model_dir: Path, engine_url: str | None, mcp_config: Path, *extra: str) -> list[str]:
    """``agentrl sample`` flags for the scripted model (``engine_url`` None: use the engines registered in the db)."""
    urls = ("--inference_urls", engine_url) if engine_url else ()
    return agentrl_cmd(
        "sample", "--db_connection_string", db_uri, "--model_name_or_path", str(model_dir), *urls,
        "--mcp_config", str(mcp_config), "--max_turns", "3",
        "--max_new_tokens", "40", "--max_concurrent_samples_per_process", "4", "--exit_when_done", "true", *extra)


def documents(db_uri: str, collection: str, query: dict | None = None) -> list[dict]:
    client = MongoClient(db_uri, tz_aware=True)
    try:
        return list(client.get_default_database()[collection].find(query or {}, sort=[("_id", 1)]))
    finally:
        client.close()
