"""Prefix merging: the LLM calls of one trajectory become as few sequences as possible, one causal pass each.

Each call stores its prompt either whole (``input_ids``) or as ``previous_call_id`` + ``prompt_delta_ids``, with
``prompt(k) == prompt(k-1) + output(k-1) + delta(k)``. A call whose full prompt extends an existing merged
sequence (that sequence is a token prefix of it) is appended to that sequence: its new prompt tokens as
context, its output as sampled tokens. Otherwise (a context reset, a template that rewrote history) a new
branch starts. Because attention is causal, the logits at every position of a merged sequence are exactly
those of the per-call pass over the same prefix, so one pass replaces one pass per call.

Token alignment (all per-token lists of a ``MergedSample``, length ``T = len(input_ids)``): index ``i`` describes
token ``input_ids[i]``. ``logprobs[i]`` is the behaviour policy's ``log p(input_ids[i] | input_ids[:i])`` on loss
tokens (0 elsewhere), which the trainer gets from the logits at position ``i - 1`` (see
``agentrl.training.logprobs``); ``loss_mask[0]`` is always 0. ``versions`` holds the weight version on every
sampled output token (trained or not) and -1 on prompt tokens; ``advantages`` is 0 off the loss tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from agentrl.store.models import DispatchedSamplingTask
from agentrl.trajectory.advantages import TRAINABLE_CALL_STATUSES


class PrefixError(ValueError):
    """The calls of a trajectory do not fit together (unknown previous call, mismatched tokens, ...)."""


@dataclass(frozen=True)
class CallTokens:
    """What merging needs from one LLM call (one ``DispatchedSamplingTask``).

    ``advantage`` is the per-call advantage from ``advantages.call_advantages``; ``None`` means no loss on this
    call (its tokens stay as context for later calls).
    """

    call_id: str
    output_ids: Sequence[int]
    output_logprobs: Sequence[float] = ()
    input_ids: Sequence[int] | None = None
    previous_call_id: str | None = None
    prompt_delta_ids: Sequence[int] = ()
    weight_version: int | None = None
    weight_version_spans: Sequence[tuple[int, int]] | None = None
    status: str = "completed"
    advantage: float | None = None
    images: Sequence[str] = ()
    """The full prompt's images (sha256) in order."""

    def output_versions(self) -> list[int]:
        """The policy version of each output token (-1: unknown)."""
        if self.weight_version_spans:
            versions = [int(v) for v, count in self.weight_version_spans for _ in range(count)]
            if len(versions) != len(self.output_ids):
                raise ValueError(f"call {self.call_id!r}: weight_version_spans cover {len(versions)} tokens, the "
                                 f"output has {len(self.output_ids)}")
            return versions
        return [-1 if self.weight_version is None else int(self.weight_version)] * len(self.output_ids)

    @classmethod
    def from_document(cls, doc: DispatchedSamplingTask, advantage: float | None) -> CallTokens:
        """The call's tokens from its stored document, with the advantage computed for it."""
        return cls(
            call_id=str(doc.id),
            output_ids=doc.output_ids,
            output_logprobs=doc.output_logprobs,
            input_ids=doc.input_ids,
            previous_call_id=doc.previous_call_id,
            prompt_delta_ids=doc.prompt_delta_ids,
            weight_version=doc.weight_version,
            weight_version_spans=doc.weight_version_spans,
            status=str(doc.status),
            advantage=advantage,
            images=doc.images,
        )


@dataclass(frozen=True)
class TurnSpan:
    """Where one call sits in a merged sequence: its new prompt tokens ``[start, output_start)``, its output
    ``[output_start, output_end)``; its full prompt is ``input_ids[:output_start]``."""

    call_id: str
    start: int
    output_start: int
    output_end: int
    trained: bool
    images: int = 0  # the images in its full prompt (the first ones of the sample's)


@dataclass
class MergedSample:
    """One branch of a trajectory as one sequence, with per-token training labels (all lists of length T)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    """The images of ``input_ids`` in order (sha256): each ``<|image_pad|>`` run is the next one's."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def turn_boundaries(self) -> list[int]:
        """Token offset where each turn's new tokens start (0 for the first)."""
        return [turn.start for turn in self.turns]

    def weighed_once(self) -> MergedSample:
        """A copy whose trained turns' advantages are divided by their number (``trajectory_weight once``): the
        branch's turns together weigh as one turn in a summed loss."""
        turns = sum(turn.trained for turn in self.turns)
        return self if turns <= 1 else replace(self, advantages=[a / turns for a in self.advantages])

    @property
    def tokens_if_unmerged(self) -> int:
        """Tokens one forward pass per trained call would process: the sum of its prompt + output lengths."""
        return sum(turn.output_end for turn in self.turns if turn.trained)

    def _append_call(self, call: CallTokens, prompt: Sequence[int], trained: bool) -> None:
        start = len(self.input_ids)
        new_prompt = prompt[start:]
        self.input_ids.extend(new_prompt)
        self.loss_mask.extend([0] * len(new_prompt))
        self.logprobs.extend([0.0] * len(new_prompt))
        self.versions.extend([-1] * len(new_prompt))
        self.advantages.extend([0.0] * len(new_prompt))
        output_start = len(self.input_ids)
        n_out = len(call.output_ids)
        self.input_ids.extend(call.output_ids)
        self.loss_mask.extend([int(trained)] * n_out)
        self.logprobs.extend(list(call.output_logprobs) if trained else [0.0] * n_out)
        self.versions.extend(call.output_versions())
        self.advantages.extend([float(call.advantage) if trained else 0.0] * n_out)
        self.images = list(call.images)
        self.turns.append(TurnSpan(call.call_id, start, output_start, len(self.input_ids), trained,
                                   len(call.images)))

    def _trim_untrained_tail(self) -> None:
        """Drop trailing calls without loss: nothing after the last trained output needs a forward pass."""
        while self.turns and not self.turns[-1].trained:
            self.turns.pop()
        end = self.turns[-1].output_end if self.turns else 0
        for name in ("input_ids", "loss_mask", "logprobs", "versions", "advantages"):
            del getattr(self, name)[end:]
        del self.images[self.turns[-1].images if self.turns else 0:]


@dataclass
class MergeResult:
    """The merged samples of one trajectory (only those with at least one trained call) and the token counts."""

    samples: list[MergedSample]

    @property
    def tokens_forwarded(self) -> int:
        return sum(sample.num_tokens for sample in self.samples)

    @property
    def tokens_if_unmerged(self) -> int:
        return sum(sample.tokens_if_unmerged for sample in self.samples)


def full_prompts(calls: Sequence[CallTokens]) -> list[list[int]]:
    """The full prompt token ids of every call, rebuilt from stored prompts and deltas.

    Raises ``PrefixError`` naming the call when a call has neither ``input_ids`` nor a ``previous_call_id``
    of an earlier call, or when its prompt is empty.
    """
    by_id: dict[str, int] = {}
    prompts: list[list[int]] = []
    for index, call in enumerate(calls):
        if call.call_id in by_id:
            raise PrefixError(f"call {call.call_id!r} appears twice in the trajectory")
        if call.input_ids is not None:
            prompt = list(call.input_ids)
        elif call.previous_call_id is None:
            raise PrefixError(f"call {call.call_id!r} has neither input_ids nor previous_call_id")
        elif call.previous_call_id not in by_id:
            raise PrefixError(
                f"call {call.call_id!r}: previous call {call.previous_call_id!r} is not an earlier call of the "
                "trajectory"
            )
        else:
            previous = by_id[call.previous_call_id]
            prompt = prompts[previous] + list(calls[previous].output_ids) + list(call.prompt_delta_ids)
        if not prompt:
            raise PrefixError(f"call {call.call_id!r} has an empty prompt")
        by_id[call.call_id] = index
        prompts.append(prompt)
    return prompts


def _is_prefix(prefix: Sequence[int], sequence: Sequence[int]) -> bool:
    return len(prefix) <= len(sequence) and list(sequence[: len(prefix)]) == list(prefix)


def merge_trajectory(
    calls: Sequence[CallTokens], trainable_statuses: Iterable[str] = TRAINABLE_CALL_STATUSES
) -> MergeResult:
    """Merge the calls of one trajectory (in call order) into samples.

    A call is trained (``loss_mask`` 1 on its output tokens, its advantage on them) when its status is in
    ``trainable_statuses`` and its advantage is not ``None``; a trained call must carry one logprob per output
    token. A call joins the most recent sample whose tokens (and images: the same ids may stand for other
    pictures) are a prefix of its full prompt's, else it starts a new sample. Samples are trimmed after their last
    trained call; samples without a trained call are left out.
    """
    statuses = frozenset(str(s) for s in trainable_statuses)
    prompts = full_prompts(calls)
    open_samples: list[MergedSample] = []
    for call, prompt in zip(calls, prompts):
        trained = call.advantage is not None and str(call.status) in statuses
        if trained and len(call.output_logprobs) != len(call.output_ids):
            raise PrefixError(
                f"call {call.call_id!r} has {len(call.output_ids)} output tokens but "
                f"{len(call.output_logprobs)} output logprobs"
            )
        target = next((s for s in reversed(open_samples)
                       if _is_prefix(s.input_ids, prompt) and _is_prefix(s.images, call.images)), None)
        if target is None:
            target = MergedSample()
            open_samples.append(target)
        target._append_call(call, prompt, trained)
    for sample in open_samples:
        sample._trim_untrained_tail()
    return MergeResult([s for s in open_samples if any(s.loss_mask)])


def verify_merged(sample: MergedSample, calls: Sequence[CallTokens]) -> None:
    """Check the prefix property of a merged sample against the calls it was built from.

    For every turn: the sample's tokens before its output equal the call's full prompt and the output span equals
    its output ids; the labels (loss mask, logprobs, versions, advantages) are exactly those the calls imply.
    Raises ``PrefixError`` naming the call or the label and the first mismatching position.
    """
    n = sample.num_tokens
    index = {call.call_id: i for i, call in enumerate(calls)}
    prompts = full_prompts(calls)
    expected: dict[str, list] = {
        "loss_mask": [0] * n,
        "logprobs": [0.0] * n,
        "versions": [-1] * n,
        "advantages": [0.0] * n,
    }
    for turn in sample.turns:
        if turn.call_id not in index:
            raise PrefixError(f"turn {turn.call_id!r} is not one of the given calls")
        call, prompt = calls[index[turn.call_id]], prompts[index[turn.call_id]]
        if turn.output_start != len(prompt) or turn.output_end != len(prompt) + len(call.output_ids):
            raise PrefixError(
                f"call {turn.call_id!r}: prompt + output cover [0, {len(prompt)}) + {len(call.output_ids)} "
                f"tokens, the sample puts them at [0, {turn.output_start}) + [{turn.output_start}, "
                f"{turn.output_end})"
            )
        if turn.output_end > n:
            raise PrefixError(f"call {turn.call_id!r} ends at token {turn.output_end}, the sample has {n}")
        got = sample.input_ids[: turn.output_start]
        if got != prompt:
            first = next(i for i, (a, b) in enumerate(zip(got, prompt)) if a != b)
            raise PrefixError(f"call {turn.call_id!r}: prompt differs from the sample at token {first}")
        if sample.input_ids[turn.output_start : turn.output_end] != list(call.output_ids):
            raise PrefixError(f"call {turn.call_id!r}: output tokens differ from the sample")
        if sample.images[:len(call.images)] != list(call.images):
            raise PrefixError(f"call {turn.call_id!r}: its prompt's images are not the sample's first ones")
        span = slice(turn.output_start, turn.output_end)
        n_out = len(call.output_ids)
        expected["versions"][span] = call.output_versions()
        if turn.trained:
            expected["logprobs"][span] = list(call.output_logprobs)
            expected["loss_mask"][span] = [1] * n_out
            expected["advantages"][span] = [call.advantage] * n_out
    for name, want in expected.items():
        got_labels = getattr(sample, name)
        if len(got_labels) != n:
            raise PrefixError(f"{name} has {len(got_labels)} entries for {n} input_ids")
        if got_labels != want:
            first = next(i for i, (a, b) in enumerate(zip(got_labels, want)) if a != b)
            raise PrefixError(f"{name} is wrong at token {first}: {got_labels[first]!r}, expected {want[first]!r}")
