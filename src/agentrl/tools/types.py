"""What the tool layer hands to the agent loop: tool specifications and call results."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.vision.images import LoadedImage


class ToolSpec(BaseModel):
    """One tool as the model sees it, plus where it lives."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    server: str = Field(description="name of the MCP server (or aggregator server) that runs the tool")
    idempotent: bool = Field(
        False, description="safe to call twice with the same arguments; only such tools are retried after a timeout"
    )

    def to_openai(self) -> dict[str, Any]:
        """The tool in OpenAI function format, as chat templates (``tools=``) expect it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


class ToolStatus(StrEnum):
    """Outcome of one tool call. The error values equal the DispatchedSamplingTask statuses
    (agentrl.store.models.CallStatus)."""

    OK = "ok"
    FORMATERROR = "formaterror"
    TOOLFAILED = "toolfailed"


class ToolResult(BaseModel):
    """Result of one tool call: ``text`` is what the model gets to read (the error message on failure), and
    ``images`` the pictures it gets to see (``ImageContent`` blocks, when the caller takes images)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    server: str | None = None
    status: ToolStatus
    text: str
    error: str | None = Field(None, description="why the call failed (None when status is ok)")
    elapsed_s: float = 0.0
    attempts: int = 0
    images: list[LoadedImage] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status is ToolStatus.OK
