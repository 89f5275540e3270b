"""Shared inference fixtures: tiny model directories and real ``agentrl engine`` subprocesses.

Registered as a plugin by ``conftest.py`` (so session fixtures are shared by
all modules). Engines run exactly as a user starts them (``python -m agentrl.cli.main engine``) on a free port,
with one CPU thread, and are stopped by PID (:class:`agentrl.inference.process.EngineProcess`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentrl.inference.process import EngineProcess
from agentrl.inference.tiny_model import build_tiny_model

TEST_FLAGS = ("--num_threads", "1", "--max_total_tokens", "8192", "--dtype", "float32")
"""fp32, as the trainer's test flags: tests compare the engine's logprobs with fp32 references (an engine's
``--dtype`` given by a test comes later and wins; ``test_trainer_precision.py`` covers ``auto``)."""
TEST_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_engine(model_dir: Path | None, *args: str, env: dict[str, str] | None = None) -> EngineProcess:
    """``agentrl engine`` on ``model_dir`` (None: the embedded model) with test sizing; not registered unless a
    database is given; ``env`` adds environment variables (e.g. ``AGENTRL_FAILPOINTS``). The caller stops it."""
    register = () if "--db_connection_string" in args else ("--no_register",)
    return EngineProcess(model_dir, *TEST_FLAGS, *register, *args, env={**TEST_ENV, **(env or {})})


@pytest.fixture(scope="session")
def launch_engine() -> Callable[..., EngineProcess]:
    """:func:`start_engine`, for tests and fixtures that start their own engine."""
    return start_engine


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the embedded model's tokenizer (seed 0)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-a"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights (seed 1): a checkpoint to load with update_weights_from_disk."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1)


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """URL of an ``agentrl engine`` serving the tiny model for the whole session (do not change its state)."""
    engine = start_engine(tiny_model_dir)
    try:
        yield engine.url
    finally:
        engine.stop()


def picture(seed: int, size: tuple[int, int] = (60, 90), kind: str = "PNG") -> bytes:
    """A seeded random picture's encoded bytes (``size`` is height, width), for the image tests."""
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(out, kind)
    return out.getvalue()


@pytest.fixture(scope="module")
def vision_engine(vision_model: Path) -> Iterator[str]:
    """URL of an ``agentrl engine`` serving the module's ``vision_model`` (a fixture each image test module
    defines: one tiny VLM family or several)."""
    engine = start_engine(vision_model)
    try:
        yield engine.url
    finally:
        engine.stop()
