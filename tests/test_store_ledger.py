"""The step ledger: each ``Metric`` lists the samples its step trained; a resume forgets the steps it lost."""

from __future__ import annotations

from agentrl.store import Store


async def test_metrics_carry_the_step_ledger_and_a_resume_forgets_lost_steps(db_uri: str) -> None:
    async with Store(db_uri) as store:
        for step in (1, 2, 3):
            await store.runs.log_metrics(step, {"loss": 0.1 * step}, sample_ids=[f"s{step}a", f"s{step}b"])
        await store.runs.log_metrics(1, {"loss": 0.5}, split="eval")
        assert (await store.db.Metric.find_one({"_id": "train/2"}))["sample_ids"] == ["s2a", "s2b"]

        # resumed from checkpoint 1: the updates of steps 2 and 3 were lost, their samples will be trained again
        assert await store.runs.forget_metrics_after(1) == 2
        remaining = sorted([doc["_id"] async for doc in store.db.Metric.find()])
        assert remaining == ["eval/1", "train/1"]
        await store.runs.log_metrics(2, {"loss": 0.3}, sample_ids=["s3a", "s2b"])  # trained again, in a new order
        ledger = [i async for doc in store.db.Metric.find({"split": "train"}) for i in doc["sample_ids"]]
        assert sorted(ledger) == ["s1a", "s1b", "s2b", "s3a"]
