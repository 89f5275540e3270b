"""Directories replaced and deleted with renames only, so a crash never leaves one half-written or half-deleted
in place (checkpoints, exported weights, merged adapters). The failpoints ``<prefix>.after_aside`` and
``<prefix>.after_rename`` name the two crash windows of a replacement."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from agentrl.failpoints import failpoint


def replace_dir(new: Path, target: Path, failpoint_prefix: str = "weights.replace") -> None:
    """Put the complete directory ``new`` at ``target`` with renames only: an existing ``target`` is first renamed
    aside to ``.<name>.old`` (so a crash never leaves a half-deleted ``target``), then ``new`` takes its place, then
    the old one is deleted. A crash in between leaves the old directory aside and ``new`` complete under its
    temporary name; neither matches a checkpoint or weights name, and the next save removes them."""
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        failpoint(f"{failpoint_prefix}.after_aside")
    os.replace(new, target)
    failpoint(f"{failpoint_prefix}.after_rename")
    shutil.rmtree(old, ignore_errors=True)


def discard_dir(path: Path) -> None:
    """Delete ``path`` after renaming it aside, so a crash mid-delete never leaves it half-deleted in place."""
    aside = path.with_name(f".{path.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
