"""The two programs of a ``humaneval`` scoring, each in a sandbox of its own: the answer's, which serves calls to its
function, and the tests', which call it through a pipe pair. Their ``main.py`` is this module's source followed by
a call of :func:`run_answer` or :func:`run_tests`, so it uses the standard library only, and the answer's and the
tests' code each run in a namespace of their own (a name of theirs cannot clobber this module's).

Calls cross by value, one JSON line each way: ``{"args": [...], "kwargs": {"dict": [...]}}``, then ``{"value": V}``
or ``{"error": "TypeError: ..."}``. ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too) and ``str`` are
themselves in JSON, lists are arrays, and the types JSON lacks are tagged: ``{"tuple": [...]}``, ``{"dict": [[key,
value], ...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": "hex"}``, ``{"complex": [real, imag]}``.
:func:`decode` builds values of exactly these built-in types, whatever the sender wrote, so no object of the
answer's reaches the tests: no ``__eq__``, ``__bool__`` or arithmetic of the answer's runs where they compare.
"""

from __future__ import annotations

import json
import linecache
import os
import reprlib
import sys
import traceback
from collections.abc import Callable
from typing import IO, Any

MAX_MESSAGE_BYTES = 16 << 20
ERROR_CHARS = 1000

_SEQUENCES: dict[str, Callable[[Any], Any]] = {"tuple": tuple, "set": set, "frozenset": frozenset}


class AnswerError(Exception):
    """In the tests: the answer's function raised, its process ended, or it replied with something else than a
    value."""


def encode(value: Any) -> Any:
    """``value`` as JSON data (instances of subclasses of the built-in types as their base type); TypeError for any
    other type."""
    if value is None or isinstance(value, bool):
        return value
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, bytes | bytearray):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {"dict": [[encode(key), encode(item)] for key, item in value.items()]}
    for tag, kind in (("tuple", tuple), ("frozenset", frozenset), ("set", set)):
        if isinstance(value, kind):
            return {tag: [encode(item) for item in value]}
    raise TypeError(f"a {type(value).__name__} cannot pass between the answer and the tests (only None, bool, int, "
                    "float, complex, str, bytes, list, tuple, dict, set and frozenset can)")


def decode(data: Any) -> Any:
    """The value that ``data`` (from ``json.loads``) encodes, built of exact built-in types; ValueError where it
    encodes none."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(item) for item in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag in _SEQUENCES and type(body) is list:
            return _SEQUENCES[tag](decode(item) for item in body)
        if tag == "dict" and type(body) is list and all(type(pair) is list and len(pair) == 2 for pair in body):
            return {decode(key): decode(item) for key, item in body}
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and len(body) == 2 and all(type(part) in (int, float)
                                                                                for part in body):
            return complex(*body)
    raise ValueError(f"not an encoded value: {reprlib.repr(data)}")


def send(stream: IO[bytes], message: Any) -> None:
    """Write ``message`` as one JSON line to an unbuffered ``stream`` (nothing is left to flush where it broke)."""
    data = memoryview(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    while data:
        data = data[stream.write(data):]


def receive(stream: IO[bytes]) -> Any:
    """The next message's JSON data; None at the end of the stream."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if len(line) > MAX_MESSAGE_BYTES or not line.endswith(b"\n"):
        raise ValueError(f"a message longer than {MAX_MESSAGE_BYTES} bytes, or cut off")
    return json.loads(line)


def serve(function: Callable[..., Any], requests: IO[bytes], replies: IO[bytes]) -> None:
    """Answer each call of the tests with ``function``'s value or exception, until the tests close ``requests``."""
    while (request := receive(requests)) is not None:
        try:
            value = encode(function(*decode(request["args"]), **decode(request["kwargs"])))
            reply = {"value": value}
        except Exception as exc:  # noqa: BLE001 - the tests see it as the call's error; BaseException (SystemExit) ends the process
            traceback.print_exc()
            reply = {"error": "".join(traceback.format_exception_only(exc)).strip()[:ERROR_CHARS]}
        send(replies, reply)


class Remote:
    """The answer's function as the tests call it: each call is sent to the answer's process by value."""

    def __init__(self, requests: IO[bytes], replies: IO[bytes]) -> None:
        self._requests, self._replies = requests, replies

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            send(self._requests, {"args": encode(list(args)), "kwargs": encode(kwargs)})
        except BrokenPipeError:
            raise AnswerError("the answer's process ended before it was called") from None
        try:
            reply = receive(self._replies)
        except (ValueError, RecursionError) as exc:
            raise AnswerError(f"the answer's reply is not JSON: {exc}") from None
        if reply is None:
            raise AnswerError("the answer's process ended before it replied")
        if type(reply) is dict and list(reply) == ["error"] and type(reply["error"]) is str:
            raise AnswerError(f"the answer raised {reply['error'][:ERROR_CHARS]}")
        if type(reply) is dict and list(reply) == ["value"]:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError) as exc:
                raise AnswerError(f"the answer's reply is not a value: {exc}") from None
        raise AnswerError(f"the answer's reply is not a value or an error: {reprlib.repr(reply)}")


def execute(source: str, filename: str) -> dict[str, Any]:
    """Run ``source`` as the program ``filename`` (tracebacks show its lines) in a namespace of its own."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": filename}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def run_answer(source: str, entry_point: str, requests_fd: int, replies_fd: int) -> None:
    """The answer's program: run the answer's code, then serve calls of its ``entry_point``."""
    function = execute(source, "answer.py").get(entry_point)
    if not callable(function):
        sys.exit(f"the answer defines no function {entry_point}")
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb", buffering=0) as replies:
        serve(function, requests, replies)


def run_tests(source: str, entry_point: str, requests_fd: int, replies_fd: int, token: str) -> None:
    """The tests' program: run the tests' code, call its ``check`` with the answer's function (also its global
    ``entry_point``, as where the answer's code runs first), and print ``token`` once ``check`` returned."""
    namespace = execute(source, "tests.py")
    with os.fdopen(requests_fd, "wb", buffering=0) as requests, os.fdopen(replies_fd, "rb") as replies:
        namespace[entry_point] = remote = Remote(requests, replies)
        namespace["check"](remote)
    print(token, flush=True)
