"""A trajectory's token view: every token with its text, loss mask, logprob, advantage and policy version.

Where the trajectory was made into a training sample (``DBRecordData``), the view is that sample, exactly as the
trainer saw it, with the trainer's own logprobs where it kept them. Otherwise (a dropped group, an evaluation, a
trajectory still running) it is rebuilt from the LLM calls: the first prompt, then each call's output (the tokens a
sample would train) and the next call's prompt delta.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


def _rounded(values: Sequence[float] | None, digits: int = 4) -> list[float] | None:
    return None if values is None else [round(float(v), digits) for v in values]


def sample_view(sample: dict[str, Any]) -> dict[str, Any]:
    """The token view of a stored training sample."""
    return {"source": "sample", "id": sample["id"], "branch": sample.get("branch", 0),
            "status": sample.get("status"), "skip_reason": sample.get("skip_reason"),
            "reward": sample.get("reward"), "ids": list(sample["input_ids"]), "mask": list(sample["loss_mask"]),
            "logprobs": _rounded(sample["logprobs"]), "versions": list(sample["versions"]),
            "advantages": _rounded(sample["advantages"]), "trainer_logprobs": _rounded(sample.get("trainer_logprobs")),
            "trainer_version": sample.get("trainer_version"), "turn_starts": list(sample.get("turn_boundaries", []))}


def calls_views(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Token views rebuilt from LLM calls (sorted by branch and turn), one per branch."""
    views: dict[int, dict[str, Any]] = {}
    for call in calls:
        view = views.get(call.get("branch", 0))
        if view is None or call.get("input_ids") is not None:
            view = views[call.get("branch", 0)] = {
                "source": "calls", "id": None, "branch": call.get("branch", 0), "status": None, "skip_reason": None,
                "reward": None, "ids": [], "mask": [], "logprobs": [], "versions": [], "advantages": None,
                "trainer_logprobs": None, "trainer_version": None, "turn_starts": []}
        prompt = call.get("input_ids") if call.get("input_ids") is not None else call.get("prompt_delta_ids", [])
        output, logprobs = call.get("output_ids", []), call.get("output_logprobs", [])
        version = call.get("weight_version")
        view["turn_starts"].append(len(view["ids"]))
        view["ids"] += list(prompt) + list(output)
        view["mask"] += [0] * len(prompt) + [1] * len(output)
        view["logprobs"] += [0.0] * len(prompt) + _rounded(list(logprobs) + [0.0] * (len(output) - len(logprobs)))
        view["versions"] += [-1] * len(prompt) + [-1 if version is None else int(version)] * len(output)
    return [views[branch] for branch in sorted(views)]


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
                from agentrl.inference.embedded_model import policy_tokenizer

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
