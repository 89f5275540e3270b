"""Policy losses: GRPO, MINIRL, GSPO and CrossEntropy (DESIGN §6, peers §1), with globally normalised sums.

Notation per token ``t`` (all tensors ``[B, T]``, aligned as in ``agentrl.training.logprobs``): ``ℓ`` the current
policy's logprob (``new_logprobs``, carries the gradient), ``ℓ_μ`` the behaviour (engine) logprob
(``old_logprobs``), ``r = exp(ℓ - ℓ_μ)``, ``A`` the advantage, ``m`` the loss mask, ``sg`` stop-gradient,
``ε = epsilon``, ``ε_h = epsilon + epsilon_higher`` (the original's band: defaults 0.2 and 0.1 give [0.8, 1.3]).

* ``GRPO``: ``L = -min(r̃·A, clip(r, 1-ε, 1+ε_h)·A)`` with ``r̃ = r``, or ``min(r, C)`` with truncated importance
  sampling (``truncated_is_cap = C``: the unclipped ratio is truncated at C, which bounds the loss of negative-
  advantage tokens the policy now over-weights, as dual-clip PPO does).
* ``MINIRL``: ``L = -sg(w)·A·ℓ`` with ``w = r`` (or ``min(r, C)``): REINFORCE weighted by the detached
  importance ratio, no clipping; the trust region is the out-of-band mask below.
* ``GSPO``: sequence ratio ``s = exp(Σ_{t∈seq} m(ℓ-ℓ_μ) / Σ_{t∈seq} m)``, used per token in the GSPO-token form
  ``ρ_t = sg(s)·exp(ℓ_t - sg(ℓ_t))`` (value ``s``, gradient ``s·∇ℓ_t``), then the GRPO formula with ``ρ`` for
  ``r``. With per-sequence length normalisation and one advantage per sequence this is exactly the GSPO
  sequence objective. (The original used ``ℓ/sg(ℓ)·sg(s)``, whose gradient ``s·∇ℓ/ℓ`` has the wrong sign.)
* ``CrossEntropy``: ``L = -ℓ`` (SFT on the loss-mask tokens; advantages and behaviour logprobs unused).
* KL to a reference policy (``kl_coef = β > 0`` and ``ref_logprobs`` given): ``+ β·k3`` on every loss token,
  ``k3 = exp(ℓ_ref - ℓ) - (ℓ_ref - ℓ) - 1``, aggregated like the policy term.

Out-of-band mask (GRPO, MINIRL, GSPO): a loss token is dropped (contributes 0) when ``ratio > U_t`` and
``A > 0``, or ``ratio < L_t`` and ``A < 0``, with ``ratio`` the loss's own ratio (``r``; ``s`` for GSPO),
``U_t = 1 + (epsilon + epsilon_higher)·k·d_t`` and ``L_t = 1 - epsilon·k·d_t``, where ``k = 1`` with
``strict_in_bound`` (band = clip range) else ``k = importance_weight_cap_ratio`` (``None``: no band), and ``d_t = exp(-out_of_date_decay · staleness_t)``
narrows the band for stale tokens (``staleness = current_version - version``, 0 where the version is unknown).
Unlike the original, strict bounds and the decay combine (the original ignored the decay under strict bounds).

Aggregation, with ``N`` the caller's GLOBAL normaliser for the whole optimiser step (``global_normaliser``):
* ``token_level_loss``: ``Σ_tokens L·M / N``, ``N`` = loss tokens of the step (all micro-batches, all ranks);
* otherwise ``Σ_seq [Σ_{t∈seq} L·M / n_seq] / N`` (``n_seq`` = loss tokens of the sequence), or without the
  ``/ n_seq`` with ``skip_length_normalization``; ``N`` = sequences of the step with at least one loss token.
* GSPO is sequence-level by definition: always the per-sequence mean divided by the step's sequences, whatever
  ``token_level_loss`` and ``skip_length_normalization`` say (``agentrl train`` warns when they ask otherwise).
  The original's README recommends MINIRL with ``token_level_loss false``, ``strict_in_bound true``,
  ``skip_length_normalization true`` and GRPO with ``token_level_loss true``; other combinations also warn.
Masked tokens leave the numerator, not ``N`` (which is fixed before the forward pass). The returned
``loss_sum`` of every micro-batch and rank add up to the step's loss, so summing their gradients gives the
step's gradient whatever the split. FSDP/DDP *average* gradients over data-parallel ranks: multiply the loss by
the data-parallel world size, or turn the division off (FSDP2: ``model.set_gradient_divide_factor(1.0)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from agentrl.training.parallel import ParallelState

LossName = Literal["GRPO", "MINIRL", "GSPO", "CrossEntropy"]

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±this before ``exp`` (a numerical guard: such tokens get no ratio gradient)."""


class LossConfig(BaseModel):
    """Loss options (flags of ``agentrl train``; names and defaults of the original where it had them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss_calculater: LossName = "GRPO"
    epsilon: float = Field(0.2, ge=0.0, lt=1.0, description="lower clip width ε")
    epsilon_higher: float = Field(0.1, ge=0.0, description="upper clip is 1 + epsilon + epsilon_higher")
    strict_in_bound: bool = Field(False, description="out-of-band mask = the clip range exactly")
    out_of_date_decay: float | None = Field(None, ge=0.0, description="band shrinks by exp(-decay·staleness)")
    importance_weight_cap_ratio: float | None = Field(
        4.0, gt=0.0, description="band width multiplier k (None: no out-of-band mask unless strict_in_bound)"
    )
    truncated_is_cap: float | None = Field(None, gt=0.0, description="truncated importance sampling cap C")
    token_level_loss: bool = Field(True, description="global token mean (else per-sequence aggregation)")
    skip_length_normalization: bool = Field(False, description="per-sequence sums instead of means")
    kl_coef: float = Field(0.0, ge=0.0, description="β of the k3 KL penalty to the reference policy")

    @model_validator(mode="after")
    def _decay_needs_band(self) -> LossConfig:
        if self.out_of_date_decay is not None and not self.has_band:
            raise ValueError("out_of_date_decay needs a band: set importance_weight_cap_ratio or strict_in_bound")
        return self

    @property
    def has_band(self) -> bool:
        return self.loss_calculater != "CrossEntropy" and (
            self.strict_in_bound or self.importance_weight_cap_ratio is not None
        )

    @property
    def normalises_by_tokens(self) -> bool:
        """Whether the global normaliser counts loss tokens (else sequences; always sequences for GSPO)."""
        return self.token_level_loss and self.loss_calculater != "GSPO"

    @property
    def length_normalised(self) -> bool:
        """Whether each sequence's sum is divided by its loss tokens (GSPO always: its objective is a mean)."""
        return self.loss_calculater == "GSPO" or not (self.token_level_loss or self.skip_length_normalization)

    @property
    def needs_seq_ids(self) -> bool:
        return self.length_normalised


@dataclass
class LossMetrics:
    """Sums and counts of one or more micro-batches; add them up, all-reduce, then read ``as_dict()``."""

    loss: float = 0.0
    loss_tokens: float = 0.0
    sequences: float = 0.0
    masked_tokens: float = 0.0
    clipped_tokens: float = 0.0
    truncated_tokens: float = 0.0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    behaviour_kl_sum: float = 0.0
    ref_kl_sum: float = 0.0

    def __add__(self, other: LossMetrics) -> LossMetrics:
        merged = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        merged["ratio_max"] = max(self.ratio_max, other.ratio_max)
        return LossMetrics(**merged)

    def all_reduce(self, parallel: ParallelState | None = None) -> LossMetrics:
        """Sum (``ratio_max``: max) over the data-parallel ranks of ``parallel``; unchanged without one."""
        if parallel is None or not parallel.distributed:
            return self
        names = [f.name for f in fields(self) if f.name != "ratio_max"]
        sums = parallel.all_reduce([getattr(self, n) for n in names], group="dp")
        (peak,) = parallel.all_reduce([self.ratio_max], op="max", group="dp")
        return LossMetrics(**dict(zip(names, sums)), ratio_max=peak)

    def as_dict(self) -> dict[str, float]:
        """Loggable values: ``loss``, fractions of loss tokens, ratio mean/max, KL means (k3)."""
        tokens = max(self.loss_tokens, 1.0)
        return {
            "loss": self.loss,
            "loss_tokens": self.loss_tokens,
            "sequences": self.sequences,
            "masked_fraction": self.masked_tokens / tokens,
            "clip_fraction": self.clipped_tokens / tokens,
            "truncated_fraction": self.truncated_tokens / tokens,
            "ratio_mean": self.ratio_sum / tokens,
            "ratio_max": self.ratio_max,
            "behaviour_kl": self.behaviour_kl_sum / tokens,
            "ref_kl": self.ref_kl_sum / tokens,
        }


class _Masked(Protocol):
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor


def count_normaliser(config: LossConfig, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> int:
    """This micro-batch's share of the normaliser: its loss tokens, or its sequences with a loss token."""
    mask = loss_mask.bool()
    if config.normalises_by_tokens:
        return int(mask.sum().item())
    if seq_ids is None:
        raise ValueError("per-sequence aggregation (token_level_loss=False) needs seq_ids")
    return int(torch.unique(seq_ids[mask]).numel())


def global_normaliser(
    config: LossConfig, micro_batches: Iterable[_Masked], parallel: ParallelState | None = None
) -> float:
    """The step's normaliser ``N``: ``count_normaliser`` summed over this rank's micro-batches and, with a
    distributed ``parallel``, over its data-parallel ranks. Call it once per optimiser step, before the first
    forward pass, on every rank."""
    local = float(sum(count_normaliser(config, mb.loss_mask, mb.seq_ids) for mb in micro_batches))
    if parallel is None:
        return local
    return parallel.all_reduce([local], group="dp")[0]


def _check_inputs(config: LossConfig, shape: torch.Size, **tensors: torch.Tensor | None) -> None:
    for key, tensor in tensors.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{key} has shape {tuple(tensor.shape)}, new_logprobs {tuple(shape)}")
    name = config.loss_calculater
    if name != "CrossEntropy" and (tensors["old_logprobs"] is None or tensors["advantages"] is None):
        raise ValueError(f"{name} needs old_logprobs and advantages")
    if config.needs_seq_ids and tensors["seq_ids"] is None:
        raise ValueError(f"{name} with this aggregation needs seq_ids")
    if config.out_of_date_decay is not None and tensors["versions"] is None:
        raise ValueError("out_of_date_decay needs versions")
    if config.kl_coef > 0 and tensors["ref_logprobs"] is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")


def _out_of_band(
    config: LossConfig,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    versions: torch.Tensor | None,
    current_version: int,
) -> torch.Tensor:
    """Tokens whose ratio left the (staleness-narrowed) band in the direction their advantage pushes."""
    k = 1.0 if config.strict_in_bound else float(config.importance_weight_cap_ratio)
    width = torch.full_like(ratio, k)
    if config.out_of_date_decay is not None:
        staleness = torch.where(versions < 0, 0, (current_version - versions).clamp_min(0))
        width = width * torch.exp(-config.out_of_date_decay * staleness.to(ratio.dtype))
    upper = 1.0 + (config.epsilon + config.epsilon_higher) * width
    lower = 1.0 - config.epsilon * width
    return ((ratio > upper) & (adv > 0)) | ((ratio < lower) & (adv < 0))


def loss_fn(
    config: LossConfig,
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor | None,
    loss_mask: torch.Tensor,
    versions: torch.Tensor | None,
    current_version: int,
    seq_ids: torch.Tensor | None,
    normaliser: float,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """This micro-batch's share of the step loss and its metrics (see the module doc for the formulas).

    All tensors have one shape (``[B, T]``): ``new_logprobs`` (float, with gradient), ``old_logprobs``
    (behaviour logprobs; ``None`` only for CrossEntropy), ``advantages`` (``None`` only for CrossEntropy),
    ``loss_mask`` (bool or 0/1), ``versions`` (long, policy version per token, -1 unknown; needed only with
    ``out_of_date_decay``), ``seq_ids`` (long, ids >= 0 of the sequence of every loss token; needed for GSPO
    and per-sequence length normalisation), ``ref_logprobs`` (reference policy, for ``kl_coef > 0``).
    ``normaliser`` is the step's global ``N``. Returns ``(loss_sum, metrics)``: a scalar with gradient, summed
    (not averaged) over micro-batches and ranks by the caller.
    """
    if not normaliser > 0:
        raise ValueError(f"normaliser must be positive (the step has no loss token?), got {normaliser}")
    _check_inputs(
        config,
        new_logprobs.shape,
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        versions=versions,
        seq_ids=seq_ids,
        ref_logprobs=ref_logprobs,
    )
    name = config.loss_calculater
    dtype = new_logprobs.dtype
    mask = loss_mask.bool()
    if not bool(mask.any()):
        # nothing to train here, but every rank must still run backward through the graph
        return (new_logprobs * 0.0).sum() / normaliser, LossMetrics()

    seq = seq_lengths = None
    if seq_ids is not None:
        if bool((seq_ids[mask] < 0).any()):
            raise ValueError("seq_ids must be >= 0 on every loss token")
        seq = torch.where(mask, seq_ids, 0)
        seq_lengths = torch.bincount(seq[mask]).to(dtype)  # index i: loss tokens of sequence i

    zero = new_logprobs.new_zeros(())
    counts: dict[str, torch.Tensor] = {"loss_tokens": mask.sum()}
    if seq_lengths is not None:
        counts["sequences"] = (seq_lengths > 0).sum()
    keep = mask
    if name == "CrossEntropy":
        per_token = -new_logprobs
    else:
        adv = advantages.to(dtype)
        log_ratio = (new_logprobs - old_logprobs.to(dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        if name == "GSPO":
            seq_log_ratio = log_ratio.new_zeros(len(seq_lengths)).index_add(0, seq[mask], log_ratio[mask])
            seq_ratio = torch.exp(seq_log_ratio.detach() / seq_lengths.clamp_min(1.0))
            band_ratio = seq_ratio[seq]
            policy_ratio = band_ratio * torch.exp(new_logprobs - new_logprobs.detach())
        else:
            band_ratio = ratio.detach()
            policy_ratio = ratio
        if config.has_band:
            out = _out_of_band(config, band_ratio, adv, versions, current_version)
            keep = mask & ~out
            counts["masked_tokens"] = (mask & out).sum()
        cap = config.truncated_is_cap
        if cap is not None:
            counts["truncated_tokens"] = (mask & (band_ratio > cap)).sum()
        if name == "MINIRL":
            weight = band_ratio if cap is None else band_ratio.clamp(max=cap)
            per_token = -weight * adv * new_logprobs
        else:
            high = 1.0 + config.epsilon + config.epsilon_higher
            unclipped = (policy_ratio if cap is None else policy_ratio.clamp(max=cap)) * adv
            clipped = policy_ratio.clamp(1.0 - config.epsilon, high) * adv
            per_token = -torch.minimum(unclipped, clipped)
            active = ((band_ratio > high) & (adv > 0)) | ((band_ratio < 1.0 - config.epsilon) & (adv < 0))
            counts["clipped_tokens"] = (keep & active).sum()
        token_ratio = ratio.detach()[mask]
        counts["ratio_sum"] = token_ratio.sum()
        counts["ratio_max"] = token_ratio.max()
        counts["behaviour_kl_sum"] = (token_ratio - 1.0 - log_ratio.detach()[mask]).sum()

    contribution = torch.where(keep, per_token, zero)
    if config.kl_coef > 0:
        ref_delta = ref_logprobs.to(dtype) - new_logprobs
        k3 = torch.exp(ref_delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) - ref_delta - 1.0
        contribution = contribution + torch.where(mask, config.kl_coef * k3, zero)
        counts["ref_kl_sum"] = k3.detach()[mask].sum()

    if config.length_normalised:
        total = torch.where(mask, contribution / seq_lengths.clamp_min(1.0)[seq], zero).sum()
    else:
        total = contribution.sum()
    loss_sum = total / normaliser
    counts["loss"] = loss_sum.detach()
    # one device-to-host transfer for all metrics
    values = torch.stack([v.to(torch.float64) for v in counts.values()]).tolist()
    metrics = LossMetrics(**dict(zip(counts, values)))
    if not math.isfinite(metrics.loss):
        raise FloatingPointError(f"{name} loss is not finite ({metrics.loss}); check the logprobs")
    return loss_sum, metrics
