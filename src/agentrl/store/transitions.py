"""Atomic state transitions with a precondition on the current state."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pymongo import ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection

from agentrl.store.errors import InvalidTransition, NotFound
from agentrl.store.models import utcnow


def sources_of(table: Mapping[StrEnum, frozenset[StrEnum]], target: StrEnum) -> list[str]:
    """States from which ``target`` may be reached."""
    return sorted(str(state) for state, targets in table.items() if target in targets)


async def transition(
    collection: AsyncCollection,
    table: Mapping[StrEnum, frozenset[StrEnum]],
    doc_id: Any,
    target: StrEnum,
    *,
    extra_filter: Mapping[str, Any] | None = None,
    set_fields: Mapping[str, Any] | None = None,
    unset_fields: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Move ``doc_id`` to ``target`` in one ``find_one_and_update`` whose filter requires an allowed source state.

    Returns the updated document. Raises ``InvalidTransition`` (naming the current state) when the document is in
    a state that does not lead to ``target``, ``NotFound`` when it does not exist or ``extra_filter`` excludes it;
    in both cases nothing is written.
    """
    allowed = sources_of(table, target)
    update: dict[str, Any] = {"$set": {"status": str(target), "updated_at": utcnow(), **(set_fields or {})}}
    if unset_fields:
        update["$unset"] = dict.fromkeys(unset_fields, "")
    query = {"_id": doc_id, "status": {"$in": allowed}, **(extra_filter or {})}
    doc = await collection.find_one_and_update(query, update, return_document=ReturnDocument.AFTER)
    if doc is not None:
        return doc
    current = await collection.find_one({"_id": doc_id}, {"status": 1})
    if current is None:
        raise NotFound(f"{collection.name} {doc_id!s} does not exist")
    if current["status"] in allowed:
        raise NotFound(f"{collection.name} {doc_id!s} does not match {dict(extra_filter or {})}")
    raise InvalidTransition(collection.name, doc_id, current["status"], str(target), allowed)
