"""A real headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages
ending in NUL on file descriptors 3 and 4), for tests that watch a page change after it loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """One headless Chromium with one page; ``evaluate`` runs JavaScript in it and returns the value."""

    def __init__(self, profile: Path):
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def wire() -> None:  # in the child: the pipes become fds 3 (commands) and 4 (replies)
            high_read, high_write = os.dup(commands_read), os.dup(replies_write)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        args = [CHROMIUM, "--headless", "--disable-gpu", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "about:blank"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
        self.process = subprocess.Popen(args, preexec_fn=wire, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(replies_write)
        self._buffer, self._next_id, self._session = b"", 0, None
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str, timeout_s: float = 30) -> None:
        """Load ``url`` and wait until the document is complete."""
        self._call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout_s)

    def evaluate(self, expression: str) -> Any:
        result = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> None:
        """Poll until ``expression`` is true in the page; AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {timeout_s} s: {expression}")
            time.sleep(0.2)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._commands)
        os.close(self._replies)
