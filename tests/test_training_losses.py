"""Losses on hand-computed tensors (values and gradients), and gradient invariance to micro-batches and ranks."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError

from agentrl.training.batching import collate, pack_micro_batches
from agentrl.training.losses import (
    LOSSES,
    LossConfig,
    LossInput,
    LossMetrics,
    aggregation,
    count_normaliser,
    global_normaliser,
    loss_fn,
    register_loss,
)
from training_core_fixtures import accumulate_gradient, rank_worker, step_samples, tiny_llama

torch.set_num_threads(1)

OLD = -1.0
# per token: ratio r, advantage A, loss mask m (ε = 0.2, ε_h = 0.3: clip [0.8, 1.3]; default band [0.2, 2.2])
RATIOS = [1.1, 1.5, 0.5, 1.5, 0.5, 3.0, 0.1, 1.0]
ADVS = [1.0, 1.0, -2.0, -1.0, 1.0, 1.0, -1.0, 1.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0]


def tensors(ratios=RATIOS, advs=ADVS, mask=MASK):
    new = torch.tensor([[OLD + math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.full_like(new, OLD).detach()
    return new, old, torch.tensor([advs], dtype=torch.float64), torch.tensor([mask], dtype=torch.bool)


def run(config: LossConfig, normaliser: float, seq_ids=None, versions=None, current=0, ref=None, **over):
    new, old, adv, mask = tensors(**over)
    if seq_ids is not None:
        seq_ids = torch.tensor([seq_ids])
    if versions is not None:
        versions = torch.tensor([versions])
    batch = LossInput(new, mask, old, adv, versions=versions, current_version=current, seq_ids=seq_ids,
                      ref_logprobs=ref)
    loss, metrics = loss_fn(config, batch, normaliser)
    loss.backward()
    return loss.item(), new.grad[0].tolist(), metrics


def test_grpo_values_and_gradients() -> None:
    loss, grad, metrics = run(LossConfig(loss_calculater="GRPO"), normaliser=7)
    # t0 inside: -1.1 | t1 clipped high: -1.3 | t2 clipped low (A<0): +1.6 | t3 A<0 unclipped: +1.5
    # t4 A>0 below band: -0.5 | t5 (r=3 > 2.2, A>0) and t6 (r=0.1 < 0.2, A<0) out of band | t7 not a loss token
    assert loss == pytest.approx((-1.1 - 1.3 + 1.6 + 1.5 - 0.5) / 7)
    # dL/dℓ = -A·r where the unclipped term is selected, else 0
    assert grad == pytest.approx([-1.1 / 7, 0, 0, 1.5 / 7, -0.5 / 7, 0, 0, 0])
    d = metrics.as_dict()
    assert d["masked_fraction"] == pytest.approx(2 / 7)
    assert d["clip_fraction"] == pytest.approx(2 / 7)
    assert d["ratio_mean"] == pytest.approx(sum(RATIOS[:7]) / 7)
    assert d["ratio_max"] == pytest.approx(3.0)
    assert d["behaviour_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS[:7]) / 7)
    assert d["loss"] == pytest.approx(loss) and d["loss_tokens"] == 7


def test_grpo_strict_in_bound_drops_clipped_tokens() -> None:
    loss, grad, metrics = run(LossConfig(loss_calculater="GRPO", strict_in_bound=True), normaliser=7)
    # band = clip range [0.8, 1.3]: t1, t2, t5, t6 dropped
    assert loss == pytest.approx((-1.1 + 1.5 - 0.5) / 7)
    assert grad == pytest.approx([-1.1 / 7, 0, 0, 1.5 / 7, -0.5 / 7, 0, 0, 0])
    assert metrics.masked_tokens == 4 and metrics.clipped_tokens == 0


def test_grpo_without_band_keeps_every_token() -> None:
    loss, grad, _ = run(LossConfig(loss_calculater="GRPO", importance_weight_cap_ratio=None), normaliser=7)
    # t5: min(3, 1.3)·1 -> -1.3 (no grad) ; t6: A<0, min(-0.1, -0.8) -> +0.8 (no grad)
    assert loss == pytest.approx((-1.1 - 1.3 + 1.6 + 1.5 - 0.5 - 1.3 + 0.8) / 7)
    assert grad == pytest.approx([-1.1 / 7, 0, 0, 1.5 / 7, -0.5 / 7, 0, 0, 0])


def test_grpo_truncated_importance_sampling() -> None:
    loss, grad, metrics = run(LossConfig(loss_calculater="GRPO", truncated_is_cap=1.4), normaliser=7)
    # t3 (A<0, r=1.5): the unclipped ratio is truncated at 1.4 -> +1.4 and no gradient
    assert loss == pytest.approx((-1.1 - 1.3 + 1.6 + 1.4 - 0.5) / 7)
    assert grad == pytest.approx([-1.1 / 7, 0, 0, 0, -0.5 / 7, 0, 0, 0])
    assert metrics.truncated_tokens == 3  # r > 1.4: t1, t3, t5


def test_minirl_values_and_gradients() -> None:
    loss, grad, metrics = run(LossConfig(loss_calculater="MINIRL"), normaliser=7)
    kept = range(5)  # t5, t6 out of band
    logp = [OLD + math.log(r) for r in RATIOS]
    # L = -sg(r)·A·ℓ ; dL/dℓ = -r·A, no clipping inside the band
    assert loss == pytest.approx(sum(-RATIOS[t] * ADVS[t] * logp[t] for t in kept) / 7)
    assert grad == pytest.approx([-RATIOS[t] * ADVS[t] / 7 if t in kept else 0.0 for t in range(8)])
    assert metrics.clipped_tokens == 0


def test_minirl_recipe_aggregation_per_sequence_sum() -> None:
    config = LossConfig(
        loss_calculater="MINIRL", strict_in_bound=True, token_level_loss=False, skip_length_normalization=True
    )
    seq_ids = [0, 0, 0, 0, 1, 1, 1, -1]
    assert count_normaliser(config, torch.tensor([MASK]), torch.tensor([seq_ids])) == 2
    loss, grad, _ = run(config, normaliser=2, seq_ids=seq_ids)
    kept = (0, 3, 4)  # strict band [0.8, 1.3]
    logp = [OLD + math.log(r) for r in RATIOS]
    assert loss == pytest.approx(sum(-RATIOS[t] * ADVS[t] * logp[t] for t in kept) / 2)
    assert grad == pytest.approx([-RATIOS[t] * ADVS[t] / 2 if t in kept else 0.0 for t in range(8)])


def test_per_sequence_length_normalisation() -> None:
    config = LossConfig(loss_calculater="GRPO", token_level_loss=False)
    seq_ids = [0, 0, 0, 1, 1, 1, 1, -1]  # sequence 0 has 3 loss tokens, sequence 1 has 4
    loss, grad, _ = run(config, normaliser=2, seq_ids=seq_ids)
    assert loss == pytest.approx(((-1.1 - 1.3 + 1.6) / 3 + (1.5 - 0.5) / 4) / 2)
    assert grad == pytest.approx([-1.1 / 6, 0, 0, 1.5 / 8, -0.5 / 8, 0, 0, 0])


def test_out_of_date_decay_narrows_the_band() -> None:
    ratios = [1.5, 1.5, 1.5, 0.75, 0.7, 1.2, 1.2]
    advs = [1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    versions = [3, 5, -1, 3, 3, 3, 5]
    mask = [1] * 7
    # current 5, decay 0.5: version 3 -> width 4·e^-1: band [1 - 0.8/e, 1 + 1.2/e] = [0.706, 1.441]
    config = LossConfig(loss_calculater="MINIRL", out_of_date_decay=0.5)
    _, grad, metrics = run(config, 7, versions=versions, current=5, ratios=ratios, advs=advs, mask=mask)
    dropped = [g == 0 for g in grad]
    assert dropped == [True, False, False, False, True, False, False]
    assert metrics.masked_tokens == 2
    # combined with strict bounds: version 3 -> band [1 - 0.2/e, 1 + 0.3/e] = [0.926, 1.110]
    strict = LossConfig(loss_calculater="MINIRL", out_of_date_decay=0.5, strict_in_bound=True)
    _, grad, _ = run(strict, 7, versions=versions, current=5, ratios=ratios, advs=advs, mask=mask)
    # (versions 5 and -1 keep the clip range [0.8, 1.3])
    assert [g == 0 for g in grad] == [True, True, True, True, True, True, False]


def test_gspo_matches_the_sequence_objective() -> None:
    # three sequences: log r means 0.05 (A=+1, inside), 0.45 (A=+1, clipped), 0.4 (A=-1, unclipped side)
    log_r = [0.1, 0.2, -0.15, 0.5, 0.4, 0.3, 0.5]
    advs = [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    seq_ids = [0, 0, 0, 1, 1, 2, 2]
    ratios = [math.exp(x) for x in log_r]
    config = LossConfig(loss_calculater="GSPO", token_level_loss=False)
    loss, grad, metrics = run(config, 3, seq_ids=seq_ids, ratios=ratios, advs=advs, mask=[1] * 7)
    s0, _s1, s2 = math.exp(0.05), math.exp(0.45), math.exp(0.4)
    assert loss == pytest.approx((-s0 - 1.3 + s2) / 3)
    # GSPO gradient: dJ/dℓ_t = -A·s/|seq| / N ; zero for the clipped sequence
    assert grad == pytest.approx([-s0 / 9] * 3 + [0.0, 0.0] + [s2 / 6] * 2)
    assert metrics.clipped_tokens == 2

    # the same gradient from the sequence-level objective written directly with autograd
    new = torch.tensor([OLD + x for x in log_r], dtype=torch.float64, requires_grad=True)
    total = new.new_zeros(())
    for ids, a in (([0, 1, 2], 1.0), ([3, 4], 1.0), ([5, 6], -1.0)):
        s = torch.exp((new[ids] - OLD).mean())
        total = total - torch.minimum(s * a, s.clamp(0.8, 1.3) * a)
    (total / 3).backward()
    assert grad == pytest.approx(new.grad.tolist())
    assert total.item() / 3 == pytest.approx(loss)


def test_gspo_is_sequence_level_whatever_token_level_loss_says() -> None:
    # sequences of 3, 2 and 2 loss tokens: a token mean would weigh sequence 0 by 3/7, GSPO weighs each by 1/3
    log_r = [0.1, 0.2, -0.15, 0.5, 0.4, 0.3, 0.5]
    advs = [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    seq_ids = [0, 0, 0, 1, 1, 2, 2]
    over = {"seq_ids": seq_ids, "ratios": [math.exp(x) for x in log_r], "advs": advs, "mask": [1] * 7}
    results = []
    for config in (LossConfig(loss_calculater="GSPO", token_level_loss=True),
                   LossConfig(loss_calculater="GSPO", token_level_loss=False),
                   LossConfig(loss_calculater="GSPO", token_level_loss=False, skip_length_normalization=True)):
        assert not aggregation(config).by_tokens and aggregation(config).needs_seq_ids
        normaliser = count_normaliser(config, torch.tensor([[1] * 7]), torch.tensor([seq_ids]))
        assert normaliser == 3  # sequences
        loss, grad, _ = run(config, normaliser, **over)
        results.append((loss, grad))
    s0, s2 = math.exp(0.05), math.exp(0.4)
    for loss, grad in results:
        assert loss == pytest.approx(results[0][0], abs=1e-12) and grad == pytest.approx(results[0][1], abs=1e-12)
        assert loss == pytest.approx((-s0 - 1.3 + s2) / 3)
        assert grad == pytest.approx([-s0 / 9] * 3 + [0.0, 0.0] + [s2 / 6] * 2)


def test_gspo_band_uses_the_sequence_ratio() -> None:
    config = LossConfig(loss_calculater="GSPO", strict_in_bound=True)
    # one sequence with token ratios 2.0 and 0.8 (s = sqrt(2.0 · 0.8) = 1.265 inside [0.8, 1.3]): no token
    # is dropped even though token 0's own ratio is out of the band
    _, grad, metrics = run(config, 1, seq_ids=[0, 0], ratios=[2.0, 0.8], advs=[1.0, 1.0], mask=[1, 1])
    s = math.sqrt(2.0 * 0.8)
    assert metrics.masked_tokens == 0
    assert grad == pytest.approx([-s / 2, -s / 2])


def test_cross_entropy() -> None:
    config = LossConfig(loss_calculater="CrossEntropy")
    new, _, _, mask = tensors()
    loss, metrics = loss_fn(config, LossInput(new, mask), normaliser=7)
    loss.backward()
    logp = [OLD + math.log(r) for r in RATIOS]
    assert loss.item() == pytest.approx(-sum(logp[:7]) / 7)
    assert new.grad[0].tolist() == pytest.approx([-1 / 7] * 7 + [0.0])
    assert metrics.masked_tokens == 0 and metrics.ratio_sum == 0


def test_kl_penalty_k3() -> None:
    beta = 0.1
    ref = torch.full((1, 8), -0.8, dtype=torch.float64)
    config = LossConfig(loss_calculater="GRPO", kl_coef=beta)
    loss, grad, metrics = run(config, 7, ref=ref)
    logp = [OLD + math.log(r) for r in RATIOS]
    k3 = [math.exp(-0.8 - lp) - (-0.8 - lp) - 1 for lp in logp]
    assert loss == pytest.approx((-1.1 - 1.3 + 1.6 + 1.5 - 0.5 + beta * sum(k3[:7])) / 7)
    # d k3 / dℓ = 1 - exp(ℓ_ref - ℓ), on every loss token (out-of-band ones too)
    pg = [-1.1, 0, 0, 1.5, -0.5, 0, 0]
    expected = [(pg[t] + beta * (1 - math.exp(-0.8 - logp[t]))) / 7 for t in range(7)] + [0.0]
    assert grad == pytest.approx(expected)
    assert metrics.as_dict()["ref_kl"] == pytest.approx(sum(k3[:7]) / 7)


def test_descent_raises_logprob_of_positive_advantage_tokens() -> None:
    """A sign check for every policy loss (the original AgentRL GSPO failed it)."""
    for name in ("GRPO", "MINIRL", "GSPO"):
        _, grad, _ = run(LossConfig(loss_calculater=name), 2, seq_ids=[0, 0], ratios=[1.0, 1.0], advs=[1.0, 1.0],
                         mask=[1, 1])
        assert all(g < 0 for g in grad), name


def test_errors_name_what_is_wrong() -> None:
    new, old, adv, mask = tensors()
    batch = LossInput(new, mask, old, adv)
    with pytest.raises(ValueError, match="normaliser must be positive"):
        loss_fn(LossConfig(), batch, normaliser=0)
    with pytest.raises(ValueError, match="GSPO with this aggregation needs seq_ids"):
        loss_fn(LossConfig(loss_calculater="GSPO"), batch, normaliser=1)
    with pytest.raises(ValueError, match="MINIRL needs old_logprobs and advantages"):
        loss_fn(LossConfig(loss_calculater="MINIRL"), LossInput(new, mask, advantages=adv), normaliser=1)
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 7\)"):
        loss_fn(LossConfig(), LossInput(new, mask, old, adv[:, :7]), normaliser=1)
    with pytest.raises(ValueError, match="out_of_date_decay needs versions"):
        loss_fn(LossConfig(out_of_date_decay=0.1), batch, normaliser=1)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        loss_fn(LossConfig(kl_coef=0.1), batch, normaliser=1)
    with pytest.raises(ValidationError, match="out_of_date_decay needs a band"):
        LossConfig(out_of_date_decay=0.1, importance_weight_cap_ratio=None)
    with pytest.raises(ValidationError):
        LossConfig(loss_calculater="PPO")  # type: ignore[arg-type]


def test_micro_batch_without_loss_tokens_still_backpropagates() -> None:
    new, old, adv, _ = tensors()
    loss, metrics = loss_fn(LossConfig(), LossInput(new, torch.zeros(1, 8, dtype=torch.bool), old, adv), 5)
    loss.backward()
    assert loss.item() == 0 and new.grad.abs().sum() == 0 and metrics.loss_tokens == 0


def test_metrics_add_up() -> None:
    a = LossMetrics(loss=1.0, loss_tokens=4, masked_tokens=1, ratio_sum=4.4, ratio_max=1.5)
    b = LossMetrics(loss=0.5, loss_tokens=6, masked_tokens=2, ratio_sum=5.6, ratio_max=2.5)
    d = (a + b).as_dict()
    assert d["loss"] == 1.5 and d["masked_fraction"] == pytest.approx(0.3)
    assert d["ratio_mean"] == pytest.approx(1.0) and d["ratio_max"] == 2.5
    assert LossMetrics().as_dict()["clip_fraction"] == 0.0
    assert LossMetrics().all_reduce() == LossMetrics()  # no process group: unchanged


def test_the_registry_names_every_loss_once() -> None:
    assert set(LOSSES) == {"GRPO", "MINIRL", "GSPO", "CrossEntropy"}
    assert [name for name, spec in LOSSES.items() if spec.sequence_level] == ["GSPO"]
    assert [name for name, spec in LOSSES.items() if not spec.policy_gradient] == ["CrossEntropy"]
    with pytest.raises(ValueError, match="registered twice"):
        register_loss("GRPO")
    with pytest.raises(ValueError, match="'PPO' is not a LossName"):
        register_loss("PPO")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ verl's implementation, to 1e-9
# verl (verl/trainer/ppo/core_algos.py) computes the same objectives with its own aggregation modes; the functions
# below restate its formulas (vanilla PPO with dual-clip, GSPO, DPPO-TV without its trust region, low_var_kl, and
# agg_loss) so that the losses here can be compared with them on random data, one sequence per row.

def verl_agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    tokens = m.sum(dim=-1)
    rows = (tokens > 0).to(loss_mat.dtype)  # rows without a loss token are left out
    per_row = (loss_mat * m).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row / (tokens + 1e-8)
    return (per_row * rows).sum() / rows.sum()


def verl_vanilla(old, logp, adv, mask, mode, low, high, clip_ratio_c):
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.min(-adv * clip_ratio_c, clipped)
    return verl_agg_loss(torch.where(adv < 0, dual, clipped), mask, mode)


def verl_gspo(old, logp, adv, mask, low, high):
    m = mask.to(logp.dtype)
    seq_log_ratio = ((logp - old) * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)
    ratio = torch.exp((logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0))
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    return verl_agg_loss(loss, mask, "seq-mean-token-mean")


def verl_dppo_tv_without_trust_region(old, logp, adv, mask, mode, clip_ratio_c):
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    return verl_agg_loss(-adv * ratio.clamp(max=clip_ratio_c).detach() * logp, mask, mode)


def verl_low_var_kl(logp, ref):
    kl = (ref - logp).clamp(-20.0, 20.0)
    return (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)


AGG_OPTIONS = {"token-mean": {"token_level_loss": True},
               "seq-mean-token-mean": {"token_level_loss": False},
               "seq-mean-token-sum": {"token_level_loss": False, "skip_length_normalization": True}}
NO_BAND = {"importance_weight_cap_ratio": None, "epsilon": 0.2, "epsilon_higher": 0.08}  # verl: clip [0.8, 1.28]
RELATIVE = {"token-mean": 1e-12, "seq-mean-token-sum": 1e-12, "seq-mean-token-mean": 1e-8}
"""Relative tolerance per mode: verl adds 1e-8 to each sequence's token count in seq-mean-token-mean."""


def random_rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, length = 6, 9
    old = -3 * torch.rand(rows, length, generator=g, dtype=torch.float64)
    new = (old + torch.randn(rows, length, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64)
    mask = torch.rand(rows, length, generator=g) < 0.7
    mask[4] = False  # a row without loss tokens
    seq_ids = torch.arange(rows).unsqueeze(1).expand(rows, length).clone()
    ref = old + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)
    return new, old, adv, mask, seq_ids, ref


def assert_equals_verl(config: LossConfig, verl_fn, seed: int, relative: float) -> None:
    """Loss and gradient equal verl's within ``relative`` (and 1e-12 absolute)."""
    new, old, adv, mask, seq_ids, ref = random_rows(seed)
    batch = LossInput(new, mask, old, adv, seq_ids=seq_ids, ref_logprobs=ref)
    loss, _ = loss_fn(config, batch, count_normaliser(config, mask, seq_ids))
    (grad,) = torch.autograd.grad(loss, new)
    verl_loss = verl_fn(old, new, adv, mask, ref)
    (verl_grad,) = torch.autograd.grad(verl_loss, new)
    assert loss.item() == pytest.approx(verl_loss.item(), rel=relative, abs=1e-12), config
    assert torch.allclose(grad, verl_grad, rtol=relative, atol=1e-12), (config, (grad - verl_grad).abs().max())
    assert grad.abs().max() > 1e-2


@pytest.mark.parametrize("mode", list(AGG_OPTIONS))
@pytest.mark.parametrize("seed", range(3))
def test_grpo_and_minirl_equal_verl(mode: str, seed: int) -> None:
    cases = [
        (LossConfig(loss_calculater="GRPO", truncated_is_cap=3.0, **NO_BAND, **AGG_OPTIONS[mode]),
         lambda old, new, adv, mask, _: verl_vanilla(old, new, adv, mask, mode, 0.2, 0.28, 3.0)),
        (LossConfig(loss_calculater="GRPO", truncated_is_cap=3.0, kl_coef=0.05, **NO_BAND, **AGG_OPTIONS[mode]),
         lambda old, new, adv, mask, ref: verl_vanilla(old, new, adv, mask, mode, 0.2, 0.28, 3.0)
         + 0.05 * verl_agg_loss(verl_low_var_kl(new, ref), mask, mode)),
        (LossConfig(loss_calculater="MINIRL", truncated_is_cap=2.0, **NO_BAND, **AGG_OPTIONS[mode]),
         lambda old, new, adv, mask, _: verl_dppo_tv_without_trust_region(old, new, adv, mask, mode, 2.0)),
    ]
    for config, verl_fn in cases:
        assert_equals_verl(config, verl_fn, seed, RELATIVE[mode])


@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_verl(seed: int) -> None:
    for options in AGG_OPTIONS.values():  # GSPO is sequence-level whatever they say
        config = LossConfig(loss_calculater="GSPO", **NO_BAND, **options)
        assert_equals_verl(config, lambda old, new, adv, mask, _: verl_gspo(old, new, adv, mask, 0.2, 0.28), seed,
                           RELATIVE["seq-mean-token-mean"])


def test_the_verl_data_clip_and_truncate() -> None:
    """The comparison above can fail: the random data clip, dual-clip and truncate tokens."""
    new, old, adv, mask, _, _ = random_rows(0)
    ratio = torch.exp(new.detach() - old)[mask]
    a = adv[mask]
    assert ((ratio > 1.28) & (a > 0)).sum() > 3 and ((ratio < 0.8) & (a < 0)).sum() > 3
    assert ((ratio > 3.0) & (a < 0)).sum() > 0 and (ratio > 2.0).sum() > 3


# ------------------------------------------------------------------------------------- invariance on a real model

CONFIGS = {
    "grpo-token": LossConfig(loss_calculater="GRPO", importance_weight_cap_ratio=2.0, truncated_is_cap=1.5),
    "gspo-seq": LossConfig(loss_calculater="GSPO", token_level_loss=False),
    "gspo-token-flag": LossConfig(loss_calculater="GSPO", token_level_loss=True),
    "minirl-recipe": LossConfig(
        loss_calculater="MINIRL", strict_in_bound=True, token_level_loss=False, skip_length_normalization=True,
        out_of_date_decay=0.2,
    ),
    "ce": LossConfig(loss_calculater="CrossEntropy"),
}


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    return tiny_llama(seed=3, dtype=torch.float64)


@pytest.fixture(scope="module")
def samples(model64: torch.nn.Module):
    return step_samples(model64)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_micro_batch_split_gives_the_same_gradient(model64, samples, name: str) -> None:
    config = CONFIGS[name]
    one = [collate(samples)]
    n = global_normaliser(config, one)
    grad_one, metrics_one = accumulate_gradient(model64, config, one, n)
    three = [collate(samples, part) for part in (range(0, 2), range(2, 5), range(5, len(samples)))]
    assert global_normaliser(config, three) == n
    grad_three, metrics_three = accumulate_gradient(model64, config, three, n)
    assert grad_one.abs().max() > 1e-3
    assert (grad_one - grad_three).abs().max().item() < 1e-10
    assert metrics_one.loss == pytest.approx(metrics_three.loss, abs=1e-12)
    if name == "grpo-token":
        # the data exercise clipping and masking, and the test can fail: per-micro-batch means differ
        assert metrics_one.clipped_tokens > 0 and metrics_one.masked_tokens > 0 and metrics_one.truncated_tokens > 0
        naive = [
            accumulate_gradient(model64, config, [mb], float(count_normaliser(config, mb.loss_mask, mb.seq_ids)))[0]
            for mb in three
        ]
        assert (sum(naive) / 3 - grad_one).abs().max().item() > 1e-3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(120)
def test_two_ranks_give_the_single_process_gradient(model64, samples, tmp_path: Path) -> None:
    config = LossConfig(loss_calculater="GRPO", token_level_loss=False)  # per-sequence means: N = sequences
    out = tmp_path / "rank0.pt"
    mp.spawn(rank_worker, args=(2, free_port(), config.model_dump_json(), str(out)), nprocs=2, join=True)
    result = torch.load(out)
    batches = pack_micro_batches(samples, max_tokens=10_000)
    n = global_normaliser(config, batches)
    grad, metrics = accumulate_gradient(model64, config, batches, n)
    assert result["normaliser"] == n
    assert (result["grad"] - grad).abs().max().item() < 1e-10
    assert result["metrics"]["loss"] == pytest.approx(metrics.loss, abs=1e-12)
    assert result["metrics"]["ratio_max"] == pytest.approx(metrics.ratio_max)
    assert result["metrics"]["loss_tokens"] == metrics.loss_tokens
