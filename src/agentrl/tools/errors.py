"""Errors of the tool layer. Each maps onto a per-call status of a DispatchedSamplingTask (CallStatus,
docs/data-model.md) (see ``ToolStatus``)."""

from __future__ import annotations


class ToolError(Exception):
    """Base class of the tool layer's errors."""


class ToolConfigError(ToolError):
    """An MCP configuration (file, flags) is invalid."""


class ToolConnectionError(ToolError):
    """A tool server could not be reached when the manager started."""


class ToolFormatError(ToolError):
    """The model asked for a tool that does not exist or gave arguments that violate the tool's schema.

    The message is meant for the model (the agent loop records the call as ``formaterror``).
    """


class ToolFailedError(ToolError):
    """A tool call failed outside the model's control: server died, timeout, transport error (``toolfailed``).

    ``sent`` tells whether the request may have reached the server; a request that was never sent can be
    retried even for tools that are not idempotent.
    """

    def __init__(self, message: str, *, sent: bool = True):
        super().__init__(message)
        self.sent = sent
