"""The grading server's own copies of submitted models: what is evaluated, and what a run's ``best_model`` is.

A submission names a directory in the agent's workspace, which the agent may change at any time, fill with
symbolic links to files it cannot read, or with FIFOs that block a reader. :meth:`SnapshotStore.take` copies the
model's regular files (its top level; subdirectories such as ``optimizer/`` are left out) into
``<store>/<digest>``, where ``digest`` is a hash of their names and contents, walking from the workspace with
``O_NOFOLLOW`` at every step, so a path swapped for a link while it is copied is refused, never followed. A
symbolic link, FIFO, socket or device among the model's files refuses the submission. Equal models share one
copy (so ``agentrl eval``, whose reuse key is the model's path and files, reuses their result); copies that are
neither in use nor kept (the best submission's) are deleted by :meth:`SnapshotStore.prune`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import threading
import uuid
from collections import Counter
from pathlib import Path

CHUNK = 8 << 20
RESERVE_BYTES = 1 << 30
"""Free space a copy must leave on the store's file system."""


class SnapshotError(ValueError):
    """A submitted model cannot be copied (the message is the submission's error, shown to the agent)."""


def _open_dir(workspace: Path, model: Path) -> int:
    """A descriptor of ``model`` opened from ``workspace`` one component at a time, never through a link."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in model.relative_to(workspace).parts:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as error:
                raise SnapshotError(f"{model} is not a directory of the workspace (symbolic links are not followed): "
                                    f"{error.strerror}") from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _model_files(directory: int, shown: Path) -> list[tuple[str, int]]:
    """``(name, size)`` of the regular files at the top of the directory ``directory``."""
    files = []
    for entry in os.scandir(directory):
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise SnapshotError(f"{shown / entry.name} is not a regular file (symbolic links, FIFOs, sockets and "
                                "devices are refused)")
        files.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    return sorted(files)


def model_files(workspace: Path, model: Path) -> list[str]:
    """The names of the regular files at the top of ``model``, found as :meth:`SnapshotStore.take` finds them."""
    directory = _open_dir(workspace, model)
    try:
        return [name for name, _ in _model_files(directory, model)]
    finally:
        os.close(directory)


def _copy(directory: int, name: str, size: int, target: Path, shown: Path) -> str:
    """Copy the first ``size`` bytes (its size when listed) of the regular file ``name`` of ``directory`` to
    ``target``; returns their SHA-256."""
    try:
        source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    except OSError as error:
        raise SnapshotError(f"{shown / name} cannot be read: {error.strerror}") from None
    digest = hashlib.sha256()
    with os.fdopen(source, "rb") as reader:
        if not stat.S_ISREG(os.fstat(reader.fileno()).st_mode):
            raise SnapshotError(f"{shown / name} is not a regular file")
        with open(target, "wb") as writer:
            while size > 0 and (chunk := reader.read(min(CHUNK, size))):
                size -= len(chunk)
                digest.update(chunk)
                writer.write(chunk)
    return digest.hexdigest()


class SnapshotStore:
    """Model copies under ``root``, reference-counted while their gradings run."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        for partial in self.root.glob(".tmp-*"):  # copies a killed server left half made
            shutil.rmtree(partial, ignore_errors=True)
        self._lock = threading.Lock()
        self._in_use: Counter[Path] = Counter()

    def take(self, workspace: Path, model: Path) -> Path:
        """Copy the model directory ``model`` (inside ``workspace``) and hold the copy until :meth:`release`.

        Raises:
            SnapshotError: the model is not a plain directory of regular files, or there is no room for it.
        """
        directory = _open_dir(workspace, model)
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            files = _model_files(directory, model)
            needed = sum(size for _, size in files)
            free = shutil.disk_usage(self.root).free
            if needed > free - RESERVE_BYTES:
                raise SnapshotError(f"{model} holds {needed / 2**30:.1f} GiB: the grading server has no room for a "
                                    f"copy ({free / 2**30:.1f} GiB free)")
            tmp.mkdir()
            digest = hashlib.sha256()
            for name, size in files:
                digest.update(f"{name}\0{_copy(directory, name, size, tmp / name, model)}\0".encode())
            final = self.root / digest.hexdigest()[:32]
            with self._lock:
                if final.is_dir():
                    shutil.rmtree(tmp)
                else:
                    os.rename(tmp, final)
                self._in_use[final] += 1
            return final
        finally:
            os.close(directory)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def release(self, snapshot: Path) -> None:
        with self._lock:
            self._in_use[snapshot] -= 1
            if self._in_use[snapshot] <= 0:
                del self._in_use[snapshot]

    def prune(self, keep: set[Path]) -> None:
        """Delete the copies that are neither in ``keep`` nor in use."""
        with self._lock:
            for path in self.root.iterdir():
                if not path.name.startswith(".") and path not in keep and path not in self._in_use:
                    with contextlib.suppress(OSError):
                        shutil.rmtree(path)
