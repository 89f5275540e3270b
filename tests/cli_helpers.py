"""Run the real `agentrl` command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def agentrl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
