"""Prefix merging and micro-batch packing: exact logprobs against per-call passes on a real tiny Llama."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from agentrl.store.models import CallStatus, DBRecordData, DispatchedSamplingTask
from agentrl.training.batching import collate, pack_micro_batches, plan_micro_batches
from agentrl.training.data import to_merged
from agentrl.training.logprobs import model_token_logprobs, token_logprobs
from agentrl.trajectory.merge import (
    CallTokens,
    MergedSample,
    PrefixError,
    full_prompts,
    merge_trajectory,
    verify_merged,
)
from training_core_fixtures import delta_trajectory, per_call_output_logprobs, random_ids, tiny_llama

torch.set_num_threads(1)


BOUND = 1e-10
"""Paths that are equal in exact arithmetic, compared in float64 (``tiny_llama(dtype=float64)``): measured ~1e-14;
in fp32 the CPU's kernels and reduction order alone move logprobs by ~1e-6."""


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=1, dtype=torch.float64)


def trajectories() -> dict[str, list[CallTokens]]:
    """Several multi-turn trajectories: plain, with a branch break, with untrained and full-prompt calls."""
    rng = random.Random(7)
    plain = delta_trajectory(rng, 4, prefix="p")
    # a branch break: turn 2 restarts from a rewritten context (full input_ids that do not extend turn 1)
    first = delta_trajectory(rng, 2, prefix="a")
    second = delta_trajectory(rng, 3, prefix="b", prompt_len=9, first_version=2)
    broken = first + second
    # a formaterror call in the middle gets no loss; a failed last call is dropped from the sample's tail
    mixed = delta_trajectory(rng, 5, prefix="m")
    mixed[2] = replace(mixed[2], status="formaterror", advantage=None)
    mixed[4] = replace(mixed[4], status="failed")
    # every call stored with its full prompt (no deltas): still one branch since each prompt extends the last
    full = delta_trajectory(rng, 3, prefix="f")
    prompts = full_prompts(full)
    full = [replace(c, input_ids=p, previous_call_id=None, prompt_delta_ids=()) for c, p in zip(full, prompts)]
    return {"plain": plain, "broken": broken, "mixed": mixed, "full": full}


@pytest.mark.parametrize("name", ["plain", "broken", "mixed", "full"])
def test_merged_pass_equals_per_call_passes(model: torch.nn.Module, name: str) -> None:
    calls = trajectories()[name]
    prompts = full_prompts(calls)
    result = merge_trajectory(calls)
    by_id = {c.call_id: (c, p) for c, p in zip(calls, prompts)}
    checked = 0
    for sample in result.samples:
        verify_merged(sample, calls)
        with torch.no_grad():
            merged = model_token_logprobs(model, torch.tensor([sample.input_ids]))[0]
        for turn in sample.turns:
            call, prompt = by_id[turn.call_id]
            alone = per_call_output_logprobs(model, prompt, list(call.output_ids))
            diff = (merged[turn.output_start : turn.output_end] - alone).abs().max().item()
            assert diff < BOUND, f"{name}/{turn.call_id}: max abs diff {diff}"
            checked += len(call.output_ids)
    expected_turns = {"plain": 4, "broken": 5, "mixed": 4, "full": 3}[name]
    assert sum(len(s.turns) for s in result.samples) == expected_turns
    assert checked > 0


def test_branch_break_makes_two_samples_and_counts_tokens() -> None:
    calls = trajectories()["broken"]
    result = merge_trajectory(calls)
    assert [[t.call_id for t in s.turns] for s in result.samples] == [["a0", "a1"], ["b0", "b1", "b2"]]
    prompts = full_prompts(calls)
    unmerged = sum(len(p) + len(c.output_ids) for c, p in zip(calls, prompts))
    assert result.tokens_if_unmerged == unmerged
    # merged: each branch forwards its last prompt + last output once
    assert result.tokens_forwarded == (len(prompts[1]) + len(calls[1].output_ids)) + (
        len(prompts[4]) + len(calls[4].output_ids)
    )
    assert result.tokens_forwarded < result.tokens_if_unmerged


def test_labels_sit_on_trained_outputs_only() -> None:
    calls = trajectories()["mixed"]
    (sample,) = merge_trajectory(calls).samples
    # the failed last call is trimmed: the sample ends with call m3's output
    assert [t.call_id for t in sample.turns] == ["m0", "m1", "m2", "m3"]
    assert sample.num_tokens == sample.turns[-1].output_end
    untrained = sample.turns[2]
    assert not untrained.trained
    span = slice(untrained.output_start, untrained.output_end)
    assert set(sample.loss_mask[span]) == {0} and set(sample.advantages[span]) == {0.0}
    assert set(sample.logprobs[span]) == {0.0}, "behaviour logprobs only on loss tokens (DBRecordData contract)"
    assert set(sample.versions[span]) == {2}, "a sampled but untrained output keeps its version"
    trained = sample.turns[3]
    span = slice(trained.output_start, trained.output_end)
    assert set(sample.loss_mask[span]) == {1}
    assert sample.logprobs[span] == list(calls[3].output_logprobs)
    assert set(sample.versions[span]) == {3}
    delta = slice(trained.start, trained.output_start)
    assert set(sample.versions[delta]) == {-1} and set(sample.loss_mask[delta]) == {0}
    assert sample.loss_mask[0] == 0
    assert sample.turn_boundaries == [t.start for t in sample.turns] and sample.turn_boundaries[0] == 0
    # unmerged counterpart: one pass per trained call
    assert sample.tokens_if_unmerged == sum(t.output_end for t in sample.turns if t.trained)


def test_trajectory_without_trained_call_gives_no_sample() -> None:
    calls = [replace(c, advantage=None) for c in trajectories()["plain"]]
    result = merge_trajectory(calls)
    assert result.samples == [] and result.tokens_forwarded == 0 and result.tokens_if_unmerged == 0


def test_verify_merged_catches_tampering() -> None:
    calls = trajectories()["plain"]
    (sample,) = merge_trajectory(calls).samples
    verify_merged(sample, calls)
    turn = sample.turns[2]
    bad_token = MergedSample(**{**sample.__dict__, "input_ids": list(sample.input_ids)})
    bad_token.input_ids[turn.start] = (bad_token.input_ids[turn.start] % 96) + 1
    with pytest.raises(PrefixError, match="differs from the sample at token"):
        verify_merged(bad_token, calls)
    shifted = MergedSample(**{**sample.__dict__, "loss_mask": [0] + sample.loss_mask[:-1]})
    with pytest.raises(PrefixError, match="loss_mask is wrong"):
        verify_merged(shifted, calls)
    wrong_version = MergedSample(**{**sample.__dict__, "versions": [v + 1 if v >= 0 else v for v in sample.versions]})
    with pytest.raises(PrefixError, match="versions is wrong"):
        verify_merged(wrong_version, calls)


def test_broken_trajectories_are_named_errors() -> None:
    calls = trajectories()["plain"]
    with pytest.raises(PrefixError, match="'p2': previous call 'p1' is not an earlier call"):
        merge_trajectory([calls[0], calls[2]])
    with pytest.raises(PrefixError, match="neither input_ids nor previous_call_id"):
        merge_trajectory([replace(calls[0], input_ids=None)])
    with pytest.raises(PrefixError, match="appears twice"):
        merge_trajectory([calls[0], calls[0]])
    with pytest.raises(PrefixError, match="'p1' has 5 output tokens but 2 output logprobs"):
        merge_trajectory([calls[0], replace(calls[1], output_ids=calls[1].output_ids[:5], output_logprobs=[-1, -1])])


def test_calls_from_stored_documents() -> None:
    first = DispatchedSamplingTask(
        _id="r/0", record_id="r", task_id="t", turn=0, status=CallStatus.COMPLETED, input_ids=[5, 6, 7],
        output_ids=[8, 9], output_logprobs=[-0.5, -0.25], weight_version=3,
    )
    second = DispatchedSamplingTask(
        _id="r/1", record_id="r", task_id="t", turn=1, status=CallStatus.TOOLFAILED, previous_call_id="r/0",
        prompt_delta_ids=[10], output_ids=[11], output_logprobs=[-2.0], weight_version=4,
    )
    calls = [CallTokens.from_document(first, 0.5), CallTokens.from_document(second, -1.0)]
    (sample,) = merge_trajectory(calls).samples
    assert sample.input_ids == [5, 6, 7, 8, 9, 10, 11]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -2.0]
    assert sample.versions == [-1, -1, -1, 3, 3, -1, 4]
    assert sample.advantages == [0.0, 0.0, 0.0, 0.5, 0.5, 0.0, -1.0]
    assert sample.turn_boundaries == [0, 5]


def test_token_logprobs_alignment() -> None:
    logits = torch.log_softmax(torch.randn(2, 4, 6, dtype=torch.float64), dim=-1)
    ids = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2]])
    out = token_logprobs(logits, ids)
    assert out[:, 0].eq(0).all()
    for b in range(2):
        for i in range(1, 4):
            assert out[b, i].item() == pytest.approx(logits[b, i - 1, ids[b, i]].item())
    tempered = token_logprobs(logits, ids, temperature=2.0)
    assert tempered[0, 1].item() == pytest.approx(torch.log_softmax(logits[0, 0] / 2, -1)[2].item())


def test_plan_respects_budget_and_places_every_sample_once() -> None:
    rng = random.Random(3)
    lengths = [rng.randrange(5, 60) for _ in range(40)] + [150]
    seqs = [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]
    groups = plan_micro_batches(seqs, max_tokens=120, min_shared=None)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        forwarded = len(group) * (max(lengths[i] for i in group) - 1)  # each row predicts its tokens after the first
        assert forwarded <= 120 or group == [40]
    assert plan_micro_batches(seqs, 120, min_shared=None) == groups


def test_padding_does_not_change_logprobs(model: torch.nn.Module) -> None:
    samples = [s for calls in trajectories().values() for s in merge_trajectory(calls).samples]
    assert len({s.num_tokens for s in samples}) > 2
    batches = pack_micro_batches(samples, max_tokens=4 * max(s.num_tokens for s in samples), pad_token_id=0)
    assert any(mb.input_ids.shape[0] > 1 for mb in batches)
    with torch.no_grad():
        for mb in batches:
            with_mask = model_token_logprobs(model, mb.input_ids, mb.attention_mask)
            causal_only = model_token_logprobs(model, mb.input_ids)
            for row, index in enumerate(mb.sample_indices):
                sample = samples[index]
                alone = model_token_logprobs(model, torch.tensor([sample.input_ids]))[0]
                n = sample.num_tokens
                assert (with_mask[row, :n] - alone).abs().max().item() < BOUND
                assert (causal_only[row, :n] - alone).abs().max().item() < BOUND
                assert mb.loss_mask[row, n:].sum() == 0 and mb.seq_ids[row, n:].eq(-1).all()
                assert mb.old_logprobs[row, :n].tolist() == pytest.approx(sample.logprobs)


def test_sequence_units() -> None:
    samples = merge_trajectory(trajectories()["broken"]).samples
    per_sample = collate(samples, sequence_unit="sample")
    assert per_sample.num_sequences == 2
    assert set(per_sample.seq_ids[1, : samples[1].num_tokens].tolist()) == {1}
    per_turn = collate(samples, sequence_unit="turn", pad_to_multiple_of=8)
    assert per_turn.input_ids.shape[1] % 8 == 0
    assert per_turn.num_sequences == 5
    for row, sample in enumerate(samples):
        for turn in sample.turns:
            ids = set(per_turn.seq_ids[row, turn.output_start : turn.output_end].tolist())
            assert len(ids) == 1 and ids != {-1}
        # every loss token has a sequence
        assert per_turn.seq_ids[row][per_turn.loss_mask[row]].ge(0).all()
    with pytest.raises(ValueError, match="sequence_unit"):
        collate(samples, sequence_unit="branch")  # type: ignore[arg-type]


def test_random_branchy_trajectories_verify() -> None:
    """Many random trajectories with random breaks: every merged sample passes the verifier."""
    rng = random.Random(11)
    for trial in range(30):
        calls: list[CallTokens] = []
        for k in range(rng.randrange(1, 8)):
            out = random_ids(rng, rng.randrange(0, 4))
            lp = [-1.0] * len(out)
            if k == 0 or rng.random() < 0.25:
                calls.append(CallTokens(f"{trial}/{k}", out, lp, input_ids=random_ids(rng, rng.randrange(1, 6))))
            else:
                calls.append(
                    CallTokens(f"{trial}/{k}", out, lp, previous_call_id=calls[-1].call_id,
                               prompt_delta_ids=random_ids(rng, rng.randrange(0, 3)), advantage=0.5, weight_version=k)
                )
        result = merge_trajectory(calls)
        for sample in result.samples:
            verify_merged(sample, calls)
        assert result.tokens_forwarded <= result.tokens_if_unmerged


def test_logprobs_of_the_scored_tokens_only_equal_the_full_pass_and_their_gradients(model) -> None:
    # The trainer runs the LM head only where trained tokens are predicted (logits_to_keep): same values, same
    # gradients as the full [B, T, V] pass.
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 24))
    scored = torch.zeros(3, 24, dtype=torch.bool)
    scored[0, 10:14] = scored[1, 20:] = scored[2, 3] = True
    full = model_token_logprobs(model, ids)
    (full * scored).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    restricted = model_token_logprobs(model, ids, scored=scored)
    (restricted * scored).sum().backward()
    assert torch.allclose(restricted[scored], full[scored].detach(), rtol=0, atol=BOUND)
    assert restricted[:, ~scored.any(dim=0)].eq(0).all()  # positions no row scores are not computed
    for expected, param in zip(full_grads, model.parameters()):
        assert torch.allclose(param.grad, expected, rtol=0, atol=BOUND)
    model.zero_grad()
    # nothing scored (a pass that pads a rank): zeros, and still a graph whose backward gives zero gradients
    nothing = model_token_logprobs(model, ids, scored=torch.zeros_like(scored))
    assert nothing.eq(0).all() and nothing.requires_grad
    nothing.sum().backward()
    assert all(p.grad is not None and p.grad.eq(0).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["plain", "broken", "mixed", "full"])
def test_turns_survive_the_database_round_trip(name: str) -> None:
    # Before: to_merged dropped the turns, so collate(sequence_unit="turn") of a stored sample gave every token the
    # sequence id -1 (and LossInput.sequences raised).
    merged = merge_trajectory(trajectories()[name]).samples
    stored = [to_merged(DBRecordData(
        id=f"r#b{i}", record_id="r", task_id="t", split="train", branch=i, seq=0, input_ids=s.input_ids,
        loss_mask=s.loss_mask, logprobs=s.logprobs, versions=s.versions, advantages=s.advantages, reward=1.0,
        turn_boundaries=s.turn_boundaries, num_tokens=s.num_tokens)) for i, s in enumerate(merged)]
    direct, round_trip = (collate(samples, sequence_unit="turn") for samples in (merged, stored))
    assert round_trip.num_sequences == direct.num_sequences == sum(t.trained for s in merged for t in s.turns)
    assert torch.equal(round_trip.seq_ids, direct.seq_ids)
    assert [[(t.start, t.output_start, t.output_end) for t in s.turns if t.trained] for s in stored] == [
        [(t.start, t.output_start, t.output_end) for t in s.turns if t.trained] for s in merged]


def test_images_are_part_of_the_prefix() -> None:
    """Image tokens are one id for every picture: a call whose ids extend a sample's but whose images do not (a
    context reset that shows another picture) starts a sample of its own; each sample keeps the images of its
    tokens, its untrained tail's dropped."""
    pad = 7
    first = CallTokens("c0", output_ids=[20, 21], output_logprobs=[-1.0, -1.0], input_ids=[1, pad, pad, 2],
                       advantage=1.0, images=["red"])
    second = CallTokens("c1", output_ids=[22], output_logprobs=[-1.0], previous_call_id="c0",
                        prompt_delta_ids=[3, pad, 4], advantage=1.0, images=["red", "blue"])
    other = CallTokens("c2", output_ids=[23], output_logprobs=[-1.0], input_ids=[1, pad, pad, 2, 20, 21, 3, pad, 4],
                       advantage=1.0, images=["green", "blue"])
    untrained = CallTokens("c3", output_ids=[24], previous_call_id="c2", prompt_delta_ids=[pad], images=[
        "green", "blue", "white"])
    result = merge_trajectory([first, second, other, untrained])
    assert [[t.call_id for t in s.turns] for s in result.samples] == [["c0", "c1"], ["c2"]]
    assert [s.images for s in result.samples] == [["red", "blue"], ["green", "blue"]]
    verify_merged(result.samples[0], [first, second])
    with pytest.raises(PrefixError, match="images are not the sample's first ones"):
        verify_merged(replace(result.samples[0], images=["blue", "red"]), [first, second])
