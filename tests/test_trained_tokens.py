"""How much of what a run sampled trained, in tokens, in `agentrl report`'s summary: the output tokens of every LLM
call, the loss tokens of the trained samples and those of them with a non-zero advantage (a per-turn estimator may
credit a turn 0 beside others that are not), read from the documents on the database."""

from __future__ import annotations

from pymongo import MongoClient

from agentrl.cli.report import build_summary, render
from agentrl.store.models import CallStatus, DBRecordData, DispatchedSamplingTask, SampleStatus
from agentrl.store.summary import trained_tokens


def sample(name: str, advantages: list[float], loss_mask: list[int], status: SampleStatus,
           split: str = "train") -> dict:
    n = len(advantages)
    return DBRecordData(id=name, record_id=name, task_id=f"{split}:t", split=split, seq=0, input_ids=[1] * n,
                        loss_mask=loss_mask, logprobs=[0.0] * n, versions=[0] * n, advantages=advantages,
                        num_tokens=n, status=status).to_mongo()


def call(name: str, task_id: str, outputs: int) -> dict:
    return DispatchedSamplingTask(id=name, record_id=name, task_id=task_id, turn=0, status=CallStatus.COMPLETED,
                                  output_ids=[3] * outputs).to_mongo()


def test_the_tokens_sampled_trained_and_credited(db_uri: str) -> None:
    client: MongoClient = MongoClient(db_uri)
    try:
        db = client.get_default_database()
        assert trained_tokens(db) == {"sampled": 0, "trained": 0, "nonzero_advantage": 0, "share": None}
        # 20 output tokens sampled for train tasks (a second round's task too); an evaluation's are not counted
        db.DispatchedSamplingTask.insert_many([call("a/0", "train:t", 8), call("b/0", "train:t@r2", 12),
                                               call("e/0", "eval-x:t", 50), call("f/0", "trainee:t", 7)])
        db.DBRecordData.insert_many([
            # a turn credited 0 (loss tokens 2, 3) beside one credited +0.5 (5, 6, 7); prompt tokens carry 0 anyway
            sample("a", [0, 0, 0, 0, 0, 0.5, 0.5, 0.5], [0, 0, 1, 1, 0, 1, 1, 1], SampleStatus.TRAINED),
            sample("b", [0, -1.0, -1.0], [0, 1, 1], SampleStatus.TRAINED),
            # not trained (queued, skipped), or another split: not counted
            sample("c", [0, 1, 1], [0, 1, 1], SampleStatus.QUEUED),
            sample("d", [0, 1, 1], [0, 1, 1], SampleStatus.SKIPPED),
            sample("e", [0, 1, 1], [0, 1, 1], SampleStatus.TRAINED, split="eval-x"),
        ])
        found = trained_tokens(db, "train")
        assert found == {"sampled": 20, "trained": 7, "nonzero_advantage": 5, "share": 5 / 20}
        assert trained_tokens(db, "eval-x") == {"sampled": 50, "trained": 2, "nonzero_advantage": 2, "share": 2 / 50}

        summary = build_summary(db, "train", {}, None)
        assert summary["trained_tokens"] == found
        assert ("tokens: 20 sampled, 7 trained, 5 of them with a non-zero advantage (25% of the sampled)"
                in render(summary))
    finally:
        client.close()
