"""The LLM calls of one trajectory, kept in memory while it runs and written together when it ends.

A trajectory's calls (``DispatchedSamplingTask``) are only ever read once it has ended: by the group stage, the
trainer's samples, audits. Writing each call as it starts and finishes cost two to four round trips per turn; a
``CallLog`` applies the same state machine (``CALL_TRANSITIONS``: ``running → completed | failed``, a completed
call re-labelled ``formaterror | toolfailed | repeaterror`` by the tool stage) in memory, and ``Calls.insert``
writes every call in one command before the trajectory's outcome (``SlotLeases.finish``), or before its slot is
given back. A trajectory cut off by a crash loses its calls with it; its slot is retried from scratch as a new
attempt, which makes its own calls.
"""

from __future__ import annotations

from typing import Any

from agentrl.store.errors import InvalidTransition
from agentrl.store.models import CALL_TRANSITIONS, CallStatus, DispatchedSamplingTask, utcnow
from agentrl.store.transitions import sources_of


class CallLog:
    """The calls of one trajectory, in the order they were made."""

    def __init__(self) -> None:
        self._calls: dict[str, DispatchedSamplingTask] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def start(self, call: DispatchedSamplingTask) -> DispatchedSamplingTask:
        """Note a call about to be sent (status ``running``)."""
        if call.id in self._calls:
            raise ValueError(f"call {call.id} was already started")
        self._calls[call.id] = call
        return call

    def finish(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``running → completed | failed`` with the response fields (output ids, logprobs, ...)."""
        fields.setdefault("finished_at", utcnow())
        return self._move(call_id, target, fields)

    def relabel(self, call_id: str, target: CallStatus, **fields: Any) -> DispatchedSamplingTask:
        """``completed → formaterror | toolfailed | repeaterror`` after the tool stage looked at the output."""
        return self._move(call_id, target, fields)

    def annotate(self, call_id: str, **fields: Any) -> DispatchedSamplingTask:
        """Add non-state fields (tool calls and results, an environment step); the status is left as it is."""
        if "status" in fields:
            raise ValueError("annotate does not change a call's status; use finish or relabel")
        return self._set(self._calls[call_id], fields)

    def end_running(self, error: str) -> None:
        """Finish every call still ``running`` as ``failed`` with ``error`` (the trajectory was cut off)."""
        for call in self._calls.values():
            if call.status == CallStatus.RUNNING:
                self.finish(call.id, CallStatus.FAILED, error=error)

    def calls(self) -> list[DispatchedSamplingTask]:
        return list(self._calls.values())

    def _move(self, call_id: str, target: CallStatus, fields: dict[str, Any]) -> DispatchedSamplingTask:
        call = self._calls[call_id]
        if target not in CALL_TRANSITIONS[CallStatus(call.status)]:
            raise InvalidTransition(DispatchedSamplingTask.collection, call_id, str(call.status), str(target),
                                    sources_of(CALL_TRANSITIONS, target))
        return self._set(call, {**fields, "status": target, "updated_at": utcnow()})  # as ``transition`` stamps it

    @staticmethod
    def _set(call: DispatchedSamplingTask, fields: dict[str, Any]) -> DispatchedSamplingTask:
        for name, value in fields.items():
            setattr(call, name, value)
        return call
