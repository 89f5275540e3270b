"""Checkpoints: ``output_dir/checkpoint-<step>`` with everything an exact resume needs.

Layout of one checkpoint directory:

* the model as a Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer) in fp32, the master
  weights themselves, loadable by transformers and SGLang; with LoRA (``--use_peft``) the adapter instead, as a
  PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer): the base weights
  never change, and a resume loads the base model and then this adapter;
* ``optimizer/``: the AdamW state in ``torch.distributed.checkpoint`` format (sharded per rank; it reshards on
  load, so a resume may use another number of ranks);
* ``scheduler.pt``, ``rng_state_<rank>.pt`` (torch CPU/CUDA and Python generators);
* ``trainer_state.json`` (:class:`TrainerState`: step, epoch, layout, version → step map), written last.

With ``--save_only_model`` (``model_only``) there is no ``optimizer/`` and no ``scheduler.pt``. A resume from such
a checkpoint starts AdamW afresh (zero moments, with a warning) and sets the learning-rate schedule to the
checkpoint's step; the data-stream state is complete, so every sample is still trained exactly once.

A checkpoint is written into ``.checkpoint-<step>.tmp`` and renamed when complete, so ``latest`` (the highest
complete step) never points at a partial one, even after a SIGKILL in the middle of saving. Directories are only
ever replaced or deleted after being renamed aside (``dirs.replace_dir``, ``dirs.discard_dir``), so no crash
leaves a half-deleted checkpoint under its name. Crash windows (failpoints): ``checkpoint.save.before_rename``,
``checkpoint.save.after_aside``, ``checkpoint.save.after_rename``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.failpoints import failpoint
from agentrl.training import lora
from agentrl.training.dirs import discard_dir, replace_dir
from agentrl.training.parallel import ParallelState
from agentrl.training.weights import export_adapter, export_pretrained

logger = logging.getLogger(__name__)

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found or read."""


@dataclass
class TrainerState:
    """The trainer's progress: ``step`` optimiser steps done, offline ``epoch``, the data-parallel layout the
    step's claims were made with, and which trainer step each published policy version came from."""

    step: int = 0
    epoch: int = 0
    dp_size: int = 1
    train_batch_size: int = 0
    version_steps: dict[int, int] = field(default_factory=dict)
    model_only: bool = False
    """In a checkpoint: saved without optimizer and scheduler state (``--save_only_model``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        data: dict[str, Any] = json.loads(text)
        data["version_steps"] = {int(k): int(v) for k, v in data.get("version_steps", {}).items()}
        return cls(**data)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / f"{PREFIX}{step}"


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir`` as ``(step, path)``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = _STEP.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(value: str | None, output_dir: Path) -> Path | None:
    """The checkpoint ``--resume_from_checkpoint`` names: a directory, or ``latest`` (None if there is none yet:
    the run starts fresh)."""
    if value is None:
        return None
    if value == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            logger.info("--resume_from_checkpoint latest: no checkpoint in %s yet, starting fresh", output_dir)
            return None
        return found[-1][1]
    path = Path(value)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"--resume_from_checkpoint {value}: not a complete checkpoint (no {STATE_FILE})")
    return path


def save_checkpoint(output_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    state: TrainerState, parallel: ParallelState, *, tokenizer: Any | None = None,
                    save_total_limit: int | None = None, model_only: bool = False) -> Path:
    """Write ``checkpoint-<state.step>`` (every rank must call this; ``model_only``: without optimizer and
    scheduler state); returns its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    final = checkpoint_dir(output_dir, state.step)
    tmp = output_dir / f".{final.name}.tmp"
    if parallel.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    parallel.barrier()
    if lora.is_adapted(model):
        export_adapter(model, parallel, tmp / "model", tokenizer=tokenizer)
    else:
        export_pretrained(model, parallel, tmp / "model", dtype=torch.float32, tokenizer=tokenizer)
    if not model_only:
        with _single_process_dcp(parallel):
            dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=str(tmp / "optimizer"), no_dist=not parallel.distributed)
    torch.save(_rng_state(), tmp / f"rng_state_{parallel.rank}.pt")
    parallel.barrier()
    if parallel.is_main:
        for item in (tmp / "model").iterdir():  # the HF files sit at the checkpoint's top level
            os.replace(item, tmp / item.name)
        (tmp / "model").rmdir()
        if not model_only:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(replace(state, model_only=model_only).to_json())
        failpoint("checkpoint.save.before_rename")
        # final exists when an earlier incarnation went further before a resume from an older checkpoint
        replace_dir(tmp, final, failpoint_prefix="checkpoint.save")
        if save_total_limit:
            for _, old in list_checkpoints(output_dir)[:-save_total_limit]:
                discard_dir(old)
    parallel.barrier()
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    parallel: ParallelState) -> TrainerState:
    """Restore optimizer, scheduler and RNG state from ``path`` (the model weights were loaded from it already);
    returns its ``TrainerState``. Every rank must call this. A ``model_only`` checkpoint leaves the optimizer
    fresh (with a warning) and steps the scheduler to the checkpoint's step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    try:
        state = TrainerState.from_json((path / STATE_FILE).read_text())
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable trainer state ({error})") from error
    if state.model_only:
        if parallel.is_main:
            logger.warning("%s was saved with --save_only_model: the optimizer state starts fresh (AdamW moments "
                           "at zero); the learning-rate schedule goes on from step %d", path, state.step)
        _advance_scheduler(scheduler, state.step)
    else:
        optim_state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        with _single_process_dcp(parallel):
            dcp.load(optim_state, checkpoint_id=str(path / "optimizer"), no_dist=not parallel.distributed)
        set_optimizer_state_dict(model, optimizer, optim_state["optimizer"])
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng_state_{parallel.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s has no RNG state for rank %d (saved with fewer ranks): random streams restart from "
                       "the seed", path, parallel.rank)
    return state


def _advance_scheduler(scheduler: Any, steps: int) -> None:
    """Step a fresh LR scheduler ``steps`` times, to where a run that saved its state would have it."""
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(steps):
            scheduler.step()


@contextlib.contextmanager
def _single_process_dcp(parallel: ParallelState) -> Iterator[None]:
    """Silence torch.distributed.checkpoint's warning that it runs without a process group (on purpose here)."""
    with warnings.catch_warnings():
        if not parallel.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
