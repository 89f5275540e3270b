"""The trainer's own error."""

from __future__ import annotations


class TrainerError(RuntimeError):
    """The trainer cannot run with this configuration or environment."""
