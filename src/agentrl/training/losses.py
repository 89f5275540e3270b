"""Policy losses: GRPO, MINIRL, GSPO and CrossEntropy, one function each, with globally normalised sums.

Notation per token ``t`` (all tensors ``[B, T]``, aligned as in ``agentrl.training.logprobs``): ``ℓ`` the current
policy's logprob (``LossInput.logprobs``, carries the gradient), ``ℓ_μ`` the behaviour (engine) logprob
(``old_logprobs``), ``r = exp(ℓ - ℓ_μ)``, ``A`` the advantage, ``m`` the loss mask, ``sg`` stop-gradient,
``ε = epsilon``, ``ε_h = epsilon + epsilon_higher`` (the original AgentRL's band: defaults 0.2 and 0.1 give [0.8, 1.3]).

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
``strict_in_bound`` (band = clip range) else ``k = importance_weight_cap_ratio`` (``None``: no band), and
``d_t = exp(-out_of_date_decay · staleness_t)`` narrows the band for stale tokens (``staleness = current_version -
version``, 0 where the version is unknown). Unlike the original, strict bounds and the decay combine (the original
ignored the decay under strict bounds).

Aggregation, with ``N`` the caller's GLOBAL normaliser for the whole optimiser step (``global_normaliser``):
* ``token_level_loss``: ``Σ_tokens L·M / N``, ``N`` = loss tokens of the step (all micro-batches, all ranks);
* otherwise ``Σ_seq [Σ_{t∈seq} L·M / n_seq] / N`` (``n_seq`` = loss tokens of the sequence), or without the
  ``/ n_seq`` with ``skip_length_normalization``; ``N`` = sequences of the step with at least one loss token.
* GSPO is sequence-level by definition: always the per-sequence mean divided by the step's sequences, whatever
  ``token_level_loss`` and ``skip_length_normalization`` say (``agentrl train`` warns when they ask otherwise).
  The original's README recommends MINIRL with ``token_level_loss false``, ``strict_in_bound true``,
  ``skip_length_normalization true`` and GRPO with ``token_level_loss true``; other combinations also warn.
Masked tokens leave the numerator, not ``N`` (which is fixed before the forward pass). The returned
``loss`` of every micro-batch and rank add up to the step's loss, so summing their gradients gives the
step's gradient whatever the split. FSDP/DDP *average* gradients over data-parallel ranks: multiply the loss by
the data-parallel world size, or turn the division off (FSDP2: ``model.set_gradient_divide_factor(1.0)``).

Structure: each loss is one function ``(LossInput, LossConfig) -> TokenLoss`` (its per-token term, the tokens it
keeps and, for a policy loss, its ratio statistics), registered under its ``LossName`` with :func:`register_loss`,
which also says whether it reads behaviour logprobs and advantages (``policy_gradient``) and whether it is
sequence-level by definition. :func:`loss_fn` picks it by ``config.loss_calculater`` and does the rest for every
loss: input checks, the KL penalty, aggregation, the normaliser and the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, NamedTuple, Protocol, get_args

import torch

from agentrl.training.loss_config import LossConfig, LossName

if TYPE_CHECKING:
    from agentrl.training.parallel import ParallelState

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ±this before ``exp`` (a numerical guard: such tokens get no ratio gradient)."""

FloatTokens = Annotated[torch.Tensor, "float [B, T]"]
BoolTokens = Annotated[torch.Tensor, "bool [B, T]"]
LongTokens = Annotated[torch.Tensor, "long [B, T]"]
PerSequence = Annotated[torch.Tensor, "[S]: one value per sequence id"]
Scalar = Annotated[torch.Tensor, "[]"]


# ----------------------------------------------------------------------------------------------------- inputs


class _Batch(Protocol):
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    seq_ids: torch.Tensor


@dataclass(frozen=True)
class Sequences:
    """The sequences of a micro-batch's loss tokens."""

    index: LongTokens
    """each loss token's sequence id (0 off the loss tokens)"""
    lengths: PerSequence
    """loss tokens of each sequence id (in the logprobs' dtype)"""


@dataclass(frozen=True, eq=False)
class LossInput:
    """One micro-batch's per-token tensors, all of one shape ``[B, T]``; what a loss reads beyond ``logprobs``
    and ``loss_mask`` depends on it and the options (``loss_fn`` checks and names what is missing)."""

    logprobs: FloatTokens
    """ℓ: the current policy's logprobs (with gradient)"""
    loss_mask: BoolTokens
    """the tokens that carry loss (bool or 0/1)"""
    old_logprobs: FloatTokens | None = None
    """ℓ_μ: the behaviour logprobs (policy losses)"""
    advantages: FloatTokens | None = None
    """A (policy losses)"""
    versions: LongTokens | None = None
    """policy version that sampled each token, -1 unknown (``out_of_date_decay``)"""
    current_version: int = 0
    """the trained policy's version (``out_of_date_decay``)"""
    seq_ids: LongTokens | None = None
    """ids >= 0 of the sequence of every loss token (GSPO, per-sequence aggregation)"""
    ref_logprobs: FloatTokens | None = None
    """the reference policy's logprobs (``kl_coef > 0``)"""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, torch.Tensor) and value.shape != shape:
                raise ValueError(f"{item.name} has shape {tuple(value.shape)}, logprobs {tuple(shape)}")

    @classmethod
    def from_batch(cls, batch: _Batch, logprobs: FloatTokens, current_version: int = 0,
                   ref_logprobs: FloatTokens | None = None) -> LossInput:
        """The loss input of a micro-batch (``agentrl.training.batching.MicroBatch``) scored ``logprobs``."""
        return cls(logprobs=logprobs, loss_mask=batch.loss_mask, old_logprobs=batch.old_logprobs,
                   advantages=batch.advantages, versions=batch.versions, current_version=current_version,
                   seq_ids=batch.seq_ids, ref_logprobs=ref_logprobs)

    @cached_property
    def mask(self) -> BoolTokens:
        return self.loss_mask.bool()

    @cached_property
    def sequences(self) -> Sequences:
        """Sequence index and lengths from ``seq_ids`` (which must be given and >= 0 on every loss token)."""
        if self.seq_ids is None:
            raise ValueError("seq_ids are needed")
        mask = self.mask
        if bool((self.seq_ids[mask] < 0).any()):
            raise ValueError("seq_ids must be >= 0 on every loss token")
        index = torch.where(mask, self.seq_ids, 0)
        return Sequences(index, torch.bincount(index[mask]).to(self.logprobs.dtype))


# ------------------------------------------------------------------------------------------ outputs, metrics


@dataclass(frozen=True)
class RatioStats:
    """What a policy loss measured over the loss tokens (0-d tensors)."""

    masked_tokens: Scalar
    """dropped by the out-of-band mask"""
    clipped_tokens: Scalar
    """kept, with the clipped term active"""
    truncated_tokens: Scalar
    """ratio above ``truncated_is_cap``"""
    ratio_sum: Scalar
    ratio_max: Scalar
    behaviour_kl_sum: Scalar
    """Σ k3(ℓ_μ ‖ ℓ) = Σ (r - 1 - log r)"""


@dataclass(frozen=True)
class TokenLoss:
    """A loss's per-token term, before the shared KL penalty and aggregation."""

    values: FloatTokens
    """``L_t``, with gradient (read only where ``keep``)"""
    keep: BoolTokens
    """the loss tokens that count (the loss mask less the dropped tokens)"""
    ratio: RatioStats | None = None
    """policy losses: their ratio statistics"""


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


class LossOutput(NamedTuple):
    """This micro-batch's share of the step loss (with gradient; summed, not averaged, over micro-batches and
    ranks by the caller) and its metrics."""

    loss: Scalar
    metrics: LossMetrics


# --------------------------------------------------------------------------------------------------- registry

LossFn = Callable[[LossInput, LossConfig], TokenLoss]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function and what the shared parts of ``loss_fn`` need to know about it."""

    fn: LossFn
    policy_gradient: bool
    """it reads ``old_logprobs`` and ``advantages`` (and ``versions`` under ``out_of_date_decay``)"""
    sequence_level: bool
    """it is a per-sequence mean by definition, whatever the aggregation options say"""


LOSSES: dict[LossName, LossSpec] = {}
"""Every loss by name (``--loss_calculater``)."""


def register_loss(name: LossName, *, policy_gradient: bool = True, sequence_level: bool = False
                  ) -> Callable[[LossFn], LossFn]:
    """Decorator: register a loss function under ``name``, which must be a ``LossName`` (the flag's choices)."""
    if name not in get_args(LossName):
        raise ValueError(f"loss {name!r} is not a LossName: add it to agentrl.training.loss_config.LossName")
    if name in LOSSES:
        raise ValueError(f"loss {name!r} is registered twice")

    def register(fn: LossFn) -> LossFn:
        LOSSES[name] = LossSpec(fn, policy_gradient, sequence_level)
        return fn

    return register


# ------------------------------------------------------------------------------------------------ aggregation


@dataclass(frozen=True)
class Aggregation:
    """How ``loss_fn`` sums the per-token terms (see the module doc)."""

    by_tokens: bool
    """the normaliser counts loss tokens (else sequences with a loss token)"""
    length_normalised: bool
    """each sequence's sum is divided by its loss tokens"""

    @property
    def needs_seq_ids(self) -> bool:
        return self.length_normalised


def aggregation(config: LossConfig) -> Aggregation:
    """The aggregation of ``config``'s loss and options (a sequence-level loss is always a per-sequence mean)."""
    sequence_level = LOSSES[config.loss_calculater].sequence_level
    return Aggregation(
        by_tokens=config.token_level_loss and not sequence_level,
        length_normalised=sequence_level or not (config.token_level_loss or config.skip_length_normalization))


class _Masked(Protocol):
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor


def count_normaliser(config: LossConfig, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None = None) -> int:
    """This micro-batch's share of the normaliser: its loss tokens, or its sequences with a loss token."""
    mask = loss_mask.bool()
    if aggregation(config).by_tokens:
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


def _aggregate(how: Aggregation, batch: LossInput, contribution: FloatTokens) -> Scalar:
    if how.length_normalised:
        sequences = batch.sequences
        per_token = contribution / sequences.lengths.clamp_min(1.0)[sequences.index]
        return torch.where(batch.mask, per_token, contribution.new_zeros(())).sum()
    return contribution.sum()


# -------------------------------------------------------------------------------------- shared policy helpers


@dataclass(frozen=True)
class TokenRatio:
    """The per-token importance ratio of a policy loss."""

    log_ratio: FloatTokens
    """``ℓ - ℓ_μ`` clamped to ±MAX_LOG_RATIO, with gradient"""
    ratio: FloatTokens
    """``r = exp(log_ratio)``, with gradient"""
    advantages: FloatTokens
    """``A`` in the logprobs' dtype"""


def token_ratio(batch: LossInput) -> TokenRatio:
    dtype = batch.logprobs.dtype
    advantages = batch.advantages.to(dtype)
    log_ratio = (batch.logprobs - batch.old_logprobs.to(dtype)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return TokenRatio(log_ratio, torch.exp(log_ratio), advantages)


def _out_of_band(config: LossConfig, batch: LossInput, ratio: FloatTokens, adv: FloatTokens) -> BoolTokens:
    """Tokens whose ratio left the (staleness-narrowed) band in the direction their advantage pushes."""
    k = 1.0 if config.strict_in_bound else float(config.importance_weight_cap_ratio)
    width = torch.full_like(ratio, k)
    if config.out_of_date_decay is not None:
        versions = batch.versions
        staleness = torch.where(versions < 0, 0, (batch.current_version - versions).clamp_min(0))
        width = width * torch.exp(-config.out_of_date_decay * staleness.to(ratio.dtype))
    upper = 1.0 + (config.epsilon + config.epsilon_higher) * width
    lower = 1.0 - config.epsilon * width
    return ((ratio > upper) & (adv > 0)) | ((ratio < lower) & (adv < 0))


def in_band(config: LossConfig, batch: LossInput, band_ratio: FloatTokens, adv: FloatTokens
            ) -> tuple[BoolTokens, Scalar]:
    """The loss tokens the out-of-band mask keeps (``band_ratio`` detached), and how many it drops."""
    mask = batch.mask
    if not config.has_band:
        return mask, mask.new_zeros((), dtype=torch.long)
    out = _out_of_band(config, batch, band_ratio, adv)
    return mask & ~out, (mask & out).sum()


def truncated_tokens(config: LossConfig, batch: LossInput, band_ratio: FloatTokens) -> Scalar:
    """Loss tokens whose ratio exceeds ``truncated_is_cap`` (0 without a cap)."""
    if config.truncated_is_cap is None:
        return batch.mask.new_zeros((), dtype=torch.long)
    return (batch.mask & (band_ratio > config.truncated_is_cap)).sum()


def ratio_stats(batch: LossInput, ratio: TokenRatio, *, masked: Scalar, clipped: Scalar, truncated: Scalar
                ) -> RatioStats:
    """The token ratio's statistics over the loss tokens, with the loss's own counts."""
    mask = batch.mask
    values = ratio.ratio.detach()[mask]
    behaviour_kl = (values - 1.0 - ratio.log_ratio.detach()[mask]).sum()
    return RatioStats(masked_tokens=masked, clipped_tokens=clipped, truncated_tokens=truncated,
                      ratio_sum=values.sum(), ratio_max=values.max(), behaviour_kl_sum=behaviour_kl)


def clipped_surrogate(config: LossConfig, batch: LossInput, ratio: TokenRatio, policy_ratio: FloatTokens,
                      band_ratio: FloatTokens) -> TokenLoss:
    """``-min(r̃·A, clip(ρ, 1-ε, 1+ε_h)·A)`` with ``ρ = policy_ratio`` (with gradient), ``r̃`` it truncated at
    ``truncated_is_cap``; clipping and the band are read on ``band_ratio`` (its detached value)."""
    adv = ratio.advantages
    keep, masked = in_band(config, batch, band_ratio, adv)
    cap = config.truncated_is_cap
    high = 1.0 + config.epsilon + config.epsilon_higher
    unclipped = (policy_ratio if cap is None else policy_ratio.clamp(max=cap)) * adv
    clipped = policy_ratio.clamp(1.0 - config.epsilon, high) * adv
    active = ((band_ratio > high) & (adv > 0)) | ((band_ratio < 1.0 - config.epsilon) & (adv < 0))
    stats = ratio_stats(batch, ratio, masked=masked, clipped=(keep & active).sum(),
                        truncated=truncated_tokens(config, batch, band_ratio))
    return TokenLoss(-torch.minimum(unclipped, clipped), keep, stats)


# ----------------------------------------------------------------------------------------------------- losses


@register_loss("GRPO")
def grpo(batch: LossInput, config: LossConfig) -> TokenLoss:
    """The clipped surrogate on the token ratio ``r``."""
    ratio = token_ratio(batch)
    return clipped_surrogate(config, batch, ratio, policy_ratio=ratio.ratio, band_ratio=ratio.ratio.detach())


@register_loss("MINIRL")
def minirl(batch: LossInput, config: LossConfig) -> TokenLoss:
    """``-sg(w)·A·ℓ`` with ``w = r`` truncated at ``truncated_is_cap``; no clipping."""
    ratio = token_ratio(batch)
    band_ratio = ratio.ratio.detach()
    keep, masked = in_band(config, batch, band_ratio, ratio.advantages)
    cap = config.truncated_is_cap
    weight = band_ratio if cap is None else band_ratio.clamp(max=cap)
    stats = ratio_stats(batch, ratio, masked=masked, clipped=masked.new_zeros(()),
                        truncated=truncated_tokens(config, batch, band_ratio))
    return TokenLoss(-weight * ratio.advantages * batch.logprobs, keep, stats)


@register_loss("GSPO", sequence_level=True)
def gspo(batch: LossInput, config: LossConfig) -> TokenLoss:
    """The clipped surrogate on ``ρ_t = sg(s)·exp(ℓ_t - sg(ℓ_t))``, ``s`` the sequence's geometric-mean ratio."""
    ratio = token_ratio(batch)
    sequences, mask = batch.sequences, batch.mask
    log_ratio = ratio.log_ratio
    seq_log_ratio = log_ratio.new_zeros(len(sequences.lengths)).index_add(0, sequences.index[mask], log_ratio[mask])
    seq_ratio = torch.exp(seq_log_ratio.detach() / sequences.lengths.clamp_min(1.0))[sequences.index]
    policy_ratio = seq_ratio * torch.exp(batch.logprobs - batch.logprobs.detach())
    return clipped_surrogate(config, batch, ratio, policy_ratio=policy_ratio, band_ratio=seq_ratio)


@register_loss("CrossEntropy", policy_gradient=False)
def cross_entropy(batch: LossInput, config: LossConfig) -> TokenLoss:
    """``-ℓ`` on every loss token."""
    return TokenLoss(-batch.logprobs, batch.mask)


# ---------------------------------------------------------------------------------------------------- loss_fn


def loss_spec(config: LossConfig) -> LossSpec:
    """The registered loss ``config`` names."""
    return LOSSES[config.loss_calculater]


def _check_inputs(config: LossConfig, spec: LossSpec, batch: LossInput) -> None:
    name = config.loss_calculater
    if spec.policy_gradient:
        if batch.old_logprobs is None or batch.advantages is None:
            raise ValueError(f"{name} needs old_logprobs and advantages")
        if config.out_of_date_decay is not None and batch.versions is None:
            raise ValueError("out_of_date_decay needs versions")
    if aggregation(config).needs_seq_ids and batch.seq_ids is None:
        raise ValueError(f"{name} with this aggregation needs seq_ids")
    if config.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")


def _metrics(loss_sum: Scalar, batch: LossInput, stats: RatioStats | None, ref_kl: Scalar | None) -> LossMetrics:
    """The micro-batch's metrics, in one device-to-host transfer."""
    zero = loss_sum.new_zeros((), dtype=torch.float64)
    sequences = (batch.sequences.lengths > 0).sum() if batch.seq_ids is not None else zero
    ratio = [getattr(stats, item.name) for item in fields(RatioStats)] if stats else [zero] * len(fields(RatioStats))
    tensors = [loss_sum.detach(), batch.mask.sum(), sequences, *ratio, zero if ref_kl is None else ref_kl]
    values = torch.stack([value.to(torch.float64) for value in tensors]).tolist()
    loss, tokens, sequence_count, masked, clipped, truncated, ratio_sum, ratio_max, behaviour_kl, ref_kl_sum = values
    return LossMetrics(loss=loss, loss_tokens=tokens, sequences=sequence_count, masked_tokens=masked,
                       clipped_tokens=clipped, truncated_tokens=truncated, ratio_sum=ratio_sum, ratio_max=ratio_max,
                       behaviour_kl_sum=behaviour_kl, ref_kl_sum=ref_kl_sum)


def loss_fn(config: LossConfig, batch: LossInput, normaliser: float) -> LossOutput:
    """This micro-batch's share of the step loss and its metrics (see the module doc for the formulas), with the
    loss ``config.loss_calculater`` names; ``normaliser`` is the step's global ``N``."""
    if not normaliser > 0:
        raise ValueError(f"normaliser must be positive (the step has no loss token?), got {normaliser}")
    spec = loss_spec(config)
    _check_inputs(config, spec, batch)
    mask = batch.mask
    if not bool(mask.any()):
        # nothing to train here, but every rank must still run backward through the graph
        return LossOutput((batch.logprobs * 0.0).sum() / normaliser, LossMetrics())
    if batch.seq_ids is not None:
        _ = batch.sequences  # checks seq_ids before any loss is computed

    token_loss = spec.fn(batch, config)
    zero = batch.logprobs.new_zeros(())
    contribution = torch.where(token_loss.keep, token_loss.values, zero)
    ref_kl = None
    if config.kl_coef > 0:
        ref_delta = batch.ref_logprobs.to(batch.logprobs.dtype) - batch.logprobs
        k3 = torch.exp(ref_delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)) - ref_delta - 1.0
        contribution = contribution + torch.where(mask, config.kl_coef * k3, zero)
        ref_kl = k3.detach()[mask].sum()
    loss_sum = _aggregate(aggregation(config), batch, contribution) / normaliser
    metrics = _metrics(loss_sum, batch, token_loss.ratio, ref_kl)
    if not math.isfinite(metrics.loss):
        raise FloatingPointError(f"{config.loss_calculater} loss is not finite ({metrics.loss}); check the logprobs")
    return LossOutput(loss_sum, metrics)
