"""``Run.policy_version`` moves only from the version its publisher expects: a second trainer publishing to the
same run is an error that leaves the document as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.store import Store, VersionConflict
from agentrl.training.publish import PendingPublish, PublishError, PublishResult, WeightPublisher


async def test_bump_needs_the_expected_current_version(db_uri: str) -> None:
    async with Store(db_uri) as store:
        await store.runs.get_or_create("demo")
        assert await store.runs.bump_policy_version("/weights/1", expected=0) == 1
        before = await store.db.Run.find_one({})
        with pytest.raises(VersionConflict, match=r"expected policy_version 0 but it is 1.*another trainer"):
            await store.runs.bump_policy_version("/weights/other", expected=0)
        assert await store.db.Run.find_one({}) == before  # unchanged, weights_path and updated_at included
        assert await store.runs.bump_policy_version("/weights/2", expected=1) == 2


async def test_publisher_does_not_move_a_version_another_trainer_moved(db_uri: str, tmp_path: Path) -> None:
    async with Store(db_uri) as store:
        await store.runs.get_or_create("demo")
        await store.runs.bump_policy_version("/elsewhere/1", expected=0)  # another trainer published version 1
        publisher = WeightPublisher(store, None, None, tmp_path, dtype=torch.float32, tokenizer=None)
        with pytest.raises(PublishError, match="another trainer"):
            await publisher.announce(PendingPublish(PublishResult(version=1, path=tmp_path / "weights" / "1"),
                                                    started=0.0, expected=None))
        run = await store.runs.get()
        assert (run.policy_version, run.weights_path) == (1, "/elsewhere/1")
