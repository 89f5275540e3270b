"""A trajectory's token view: every token with its text, loss mask, logprob, advantage and policy version.

Where the trajectory was made into a training sample (``DBRecordData``), the view is that sample, exactly as the
trainer saw it, with the trainer's own logprobs where it kept them. Otherwise (a dropped group, an evaluation, a
trajectory still running) it is rebuilt from the LLM calls by the same prefix merge that makes samples.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from agentrl.store.models import CallStatus, DispatchedSamplingTask
from agentrl.trajectory.merge import CallTokens, merge_trajectory

logger = logging.getLogger(__name__)


ALL_CALL_STATUSES = frozenset(str(status) for status in CallStatus)


def _rounded(values: Sequence[float] | None, digits: int = 4) -> list[float] | None:
    return None if values is None else [round(float(v), digits) for v in values]


def _view(source: str, ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
          turn_starts: Sequence[int], **details: Any) -> dict[str, Any]:
    """A token view: per-token lists of equal length, and what the page says about where they come from."""
    view = {"source": source, "id": None, "branch": 0, "status": None, "skip_reason": None, "reward": None,
            "advantages": None, "trainer_logprobs": None, "trainer_version": None, "images": []}
    view.update(details)
    view.update(ids=list(ids), mask=list(mask), logprobs=_rounded(logprobs), versions=list(versions),
                turn_starts=list(turn_starts), advantages=_rounded(view["advantages"]),
                trainer_logprobs=_rounded(view["trainer_logprobs"]))
    return view


IMAGE_PAD = "<|image_pad|>"
"""The text of the Qwen-VL image token: a run of them is one image of the view's ``images``."""


def image_runs(view: dict[str, Any], run: str) -> list[dict[str, Any]]:
    """Where each of the view's images sits among its tokens, ``{start, end, sha256, url}`` in order (the ``i``-th
    run of image tokens is its ``i``-th image), for the page to show the picture there."""
    runs, texts, images = [], view.get("texts") or [], view.get("images") or []
    i = 0
    while i < len(texts) and len(runs) < len(images):
        if texts[i] != IMAGE_PAD:
            i += 1
            continue
        end = i
        while end < len(texts) and texts[end] == IMAGE_PAD:
            end += 1
        sha256 = images[len(runs)]
        runs.append({"start": i, "end": end, "sha256": sha256, "url": f"/api/runs/{run}/images/{sha256}"})
        i = end
    return runs


def sample_view(sample: dict[str, Any]) -> dict[str, Any]:
    """The token view of a stored training sample."""
    return _view("sample", sample["input_ids"], sample["loss_mask"], sample["logprobs"], sample["versions"],
                 sample.get("turn_boundaries", []), images=sample.get("images", []), id=sample["id"],
                 branch=sample.get("branch", 0),
                 status=sample.get("status"), skip_reason=sample.get("skip_reason"), reward=sample.get("reward"),
                 advantages=sample["advantages"], trainer_logprobs=sample.get("trainer_logprobs"),
                 trainer_version=sample.get("trainer_version"))


def calls_views(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Token views rebuilt from a trajectory's LLM calls (in turn order) by the trainer's own prefix merge
    (:func:`agentrl.trajectory.merge.merge_trajectory`), so branches are those a sample would have. Every call's
    output is marked as sampled, whatever its status; a call without one logprob per output token stays context.
    Raises :class:`~agentrl.trajectory.merge.PrefixError` when the calls do not fit together."""
    tokens = []
    for call in calls:
        doc = DispatchedSamplingTask.model_validate(call)
        has_logprobs = len(doc.output_logprobs) == len(doc.output_ids)
        tokens.append(CallTokens.from_document(doc, advantage=0.0 if has_logprobs else None))
    merged = merge_trajectory(tokens, trainable_statuses=ALL_CALL_STATUSES)
    return [_view("calls", s.input_ids, s.loss_mask, s.logprobs, s.versions, s.turn_boundaries, branch=branch,
                  images=s.images) for branch, s in enumerate(merged.samples)]


class TokenTexts:
    """Each token id's text under a run's tokenizer (loaded once per model, decoded once per id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizers: dict[str, Any] = {}
        self._texts: dict[str, dict[int, str]] = {}

    def _tokenizer(self, model: str | None) -> Any:
        key = model or ""
        with self._lock:
            if key not in self._tokenizers:
                from agentrl.inference.policy_tokenizer import policy_tokenizer

                try:
                    self._tokenizers[key] = policy_tokenizer(model)
                except (OSError, ValueError) as error:
                    logger.warning("cannot load the tokenizer of %s (%s): tokens are shown as ids",
                                   model or "the embedded model", error)
                    self._tokenizers[key] = None
                self._texts[key] = {}
            return self._tokenizers[key]

    def texts(self, model: str | None, ids: Sequence[int]) -> list[str] | None:
        """The text of every token of ``ids`` (``None`` when the model's tokenizer cannot be loaded)."""
        tokenizer = self._tokenizer(model)
        if tokenizer is None:
            return None
        known = self._texts[model or ""]
        missing = [i for i in dict.fromkeys(ids) if i not in known]
        if missing:
            decoded = tokenizer.batch_decode([[i] for i in missing], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
            known.update(zip(missing, decoded))
        return [known[i] for i in ids]
