"""Helpers for store tests: building Tasks without going through a file."""

from __future__ import annotations

from pymongo import AsyncMongoClient

from agentrl.store import Store, Task
from agentrl.store.task_files import UploadDefaults, parse_entry


def make_task(index: int, *, split: str = "train", num_generations: int = 4, max_attempts: int = 3) -> Task:
    defaults = UploadDefaults(split=split, num_generations=num_generations, scorer="math",
                              answer_schema="boxed", max_attempts=max_attempts)
    return parse_entry({"id": f"t{index:04d}", "question": f"What is {index} + 1?", "answer": str(index + 1)},
                       defaults, order=index)


async def insert_tasks(store: Store, count: int, **kwargs) -> list[Task]:
    tasks = [make_task(i, **kwargs) for i in range(count)]
    await store.db[Task.collection].insert_many([t.to_mongo() for t in tasks])
    return tasks


def raw_client(uri: str) -> AsyncMongoClient:
    return AsyncMongoClient(uri, tz_aware=True)
