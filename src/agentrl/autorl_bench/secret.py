"""The benchmark installation's secret: what makes the built-in scenarios' held-out sets unguessable.

A held-out set that is a deterministic function of code and data the agent can see is not held out: an agent
imports the generator and rebuilds it. So every generated held-out set is drawn from a random secret made once
per installation (``secret.key`` in the bench's state directory, :func:`agentrl.autorl_bench.scenarios.bench_home`,
which a contained agent never sees). The same installation keeps the same secret, hence the same held-out sets,
so its baselines and later submissions stay comparable; deleting the file makes new sets on next use.

The file is made atomically (written under a temporary name, then hard-linked into place): two processes that
start together agree on one secret, and a crash leaves either no secret or a whole one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "secret.key"
SECRET_BYTES = 32


class SecretError(RuntimeError):
    """The installation's secret exists but cannot be read or is malformed."""


def installation_secret(home: Path) -> bytes:
    """The secret in ``home/secret.key``, made on first use (readable by its owner only)."""
    path = home / SECRET_FILE
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = home / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process made it first: then theirs counts
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        text = path.read_text().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError) as error:
        raise SecretError(f"{path}: cannot read the benchmark's secret ({error}); delete the file to make a new one "
                          "(the built-in held-out sets then change, and earlier scores are not comparable)") from None
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"{path}: expected {SECRET_BYTES * 2} hex digits, found {len(text)} characters; delete the "
                          "file to make a new one")
    return secret


def derived_seed(secret: bytes, purpose: str) -> int:
    """A 64-bit seed for ``purpose`` (e.g. ``"arith/test"``): independent per purpose, unknowable without the
    secret."""
    return int.from_bytes(hmac.new(secret, purpose.encode(), hashlib.sha256).digest()[:8], "big")


def secret_id(secret: bytes) -> str:
    """A short public name of the secret (a hash of it), stamped on the data made from it."""
    return hashlib.sha256(b"agentrl-bench-secret-id:" + secret).hexdigest()[:16]
