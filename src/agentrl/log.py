"""Logging set-up and redaction of credentials in anything that may be printed or logged."""

from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^/@\s]+)@")
_SECRET_PARAM = re.compile(
    r"(?P<key>(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|authSource)=)(?P<value>[^&\s]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<key>Bearer\s+)(?P<value>[A-Za-z0-9._\-~+/=]+)")


def redact(text: str) -> str:
    """Hide credentials in URIs (``user:pass@``), secret query parameters and bearer tokens."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)
    text = _SECRET_PARAM.sub(lambda m: f"{m['key']}***", text)
    return _BEARER.sub(lambda m: f"{m['key']}***", text)


class RedactingFilter(logging.Filter):
    """Logging filter that redacts every record's final message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


class StderrHandler(logging.StreamHandler):
    """A stream handler on the ``sys.stderr`` of the moment each record is written, not the one at set-up: a run
    started in a process whose stderr is later replaced (``contextlib.redirect_stderr``, pytest's capture) logs to
    the new one, never to a closed stream."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:  # StreamHandler.__init__ assigns one: ignored
        pass


def setup_logging(verbose: bool = False) -> None:
    """Configure the root logger once: timestamped lines on stderr, credentials redacted."""
    root = logging.getLogger()
    if any(isinstance(f, RedactingFilter) for h in root.handlers for f in h.filters):
        return
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(RedactingFilter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("pymongo", "httpx", "httpcore", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
