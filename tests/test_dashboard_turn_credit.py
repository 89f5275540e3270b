"""The record page shows each turn's credit (per-turn estimators): its step reward, return, advantage and state."""

from __future__ import annotations

from fastapi.testclient import TestClient
from pymongo import MongoClient

from agentrl.dashboard.app import create_app
from agentrl.store.models import DispatchedSamplingTask, Record, Task, utcnow
from agentrl.store.runs import RUN_ID
from store_helpers import make_task


def test_the_record_page_shows_each_turns_credit(db_uri: str, db_name: str) -> None:
    client = MongoClient(db_uri, tz_aware=True)
    try:
        db = client[db_name]
        db["Run"].insert_one({"_id": RUN_ID, "name": db_name, "status": "finished"})
        task = make_task(0, num_generations=2)
        db[Task.collection].insert_one(task.to_mongo())
        for record_id, credited in ((f"{task.id}/0/1", True), (f"{task.id}/1/1", False)):
            db[Record.collection].insert_one(Record(
                id=record_id, task_id=task.id, slot=0, attempt=1, lease_id="l", lease_owner="s", leased=False,
                lease_expires_at=utcnow(), status="trained", score=1.0, num_turns=2).to_mongo())
            calls = [DispatchedSamplingTask(id=f"{record_id}/c{turn}", record_id=record_id, task_id=task.id, turn=turn,
                                            status="completed", input_ids=[1, 2], output_ids=[3],
                                            output_logprobs=[-0.5], output_text=f"action {turn}").to_mongo()
                     for turn in (0, 1)]
            if not credited:  # a database written before the per-turn fields existed
                for call in calls:
                    for field in ("step_reward", "done", "state_key", "advantage", "step_return"):
                        call.pop(field)
            else:
                calls[0].update(step_reward=0.0, state_key="planks|", advantage=-0.25, step_return=0.95)
                calls[1].update(step_reward=1.0, state_key="planks|oak_logs:1", advantage=0.75, step_return=1.0)
            db[DispatchedSamplingTask.collection].insert_many(calls)
        with TestClient(create_app(client)) as http:
            credited_page = http.get(f"/runs/{db_name}/records/{task.id}/0/1").text
            plain_page = http.get(f"/runs/{db_name}/records/{task.id}/1/1").text
        assert "step reward 0" in credited_page and "return 0.95" in credited_page
        assert "advantage -0.25" in credited_page and "advantage 0.75" in credited_page
        assert "planks|oak_logs:1" in credited_page
        assert "step reward" not in plain_page and "return 0" not in plain_page
    finally:
        client.close()
