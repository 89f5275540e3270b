"""The loss options: one pydantic model, the ``loss`` part of the trainer's configuration.

Each field is a flag of ``agentrl train`` under its own name (``--loss_calculater``, ``--epsilon``...: the original
AgentRL's names and defaults). The formulas are in :mod:`agentrl.training.losses`, whose registry holds one function per
``LossName``. This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossName = Literal["GRPO", "MINIRL", "GSPO", "CrossEntropy"]
"""The losses of ``agentrl.training.losses.LOSSES`` (``--loss_calculater``'s choices)."""

RECIPES: dict[str, dict[str, bool]] = {
    "MINIRL": {"token_level_loss": False, "strict_in_bound": True, "skip_length_normalization": True},
    "GRPO": {"token_level_loss": True},
}
"""The settings the original's README recommends with each loss."""

RATIO_FLAGS = ("epsilon", "epsilon_higher", "strict_in_bound", "out_of_date_decay", "importance_weight_cap_ratio",
               "truncated_is_cap")
"""Options of the importance ratio, which CrossEntropy does not have."""


def flag(name: str, value: Any) -> str:
    """``--name value`` as written on a command line (booleans ``true``/``false``)."""
    return f"--{name} {str(value).lower() if isinstance(value, bool) else value}"


class LossConfig(BaseModel):
    """Loss options (flags of ``agentrl train``; names and defaults of the original where it had them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loss_calculater: LossName = Field("GRPO", description="GRPO, MINIRL, GSPO or CrossEntropy (SFT)")
    epsilon: float = Field(0.2, ge=0.0, lt=1.0, description="lower clip width ε")
    epsilon_higher: float = Field(0.1, ge=0.0, description="the upper clip is 1 + epsilon + epsilon_higher")
    strict_in_bound: bool = Field(False, description="out-of-band token mask = the clip range exactly")
    out_of_date_decay: float | None = Field(None, ge=0.0, description="band shrinks by exp(-decay × staleness)")
    importance_weight_cap_ratio: float | None = Field(
        4.0, gt=0.0, description="out-of-band mask width multiplier (none: no mask unless strict_in_bound)")
    truncated_is_cap: float | None = Field(None, gt=0.0, description="truncated importance sampling cap")
    token_level_loss: bool = Field(True, description="global token mean (false: per-sequence aggregation)")
    skip_length_normalization: bool = Field(False, description="per-sequence sums instead of means")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL penalty to the reference model")
    trajectory_weight: Literal["turns", "once"] = Field(
        "turns", description="turns: every trained turn counts in full (a trajectory of K turns weighs about K "
        "one-turn ones); once: each turn's advantages are divided by the trained turns of its sample, so every "
        "trajectory (branch) weighs as much as one turn, whatever its length (summed aggregation only)")

    @model_validator(mode="after")
    def _decay_needs_band(self) -> LossConfig:
        if self.out_of_date_decay is not None and not self.has_band:
            raise ValueError("out_of_date_decay needs a band: set importance_weight_cap_ratio or strict_in_bound")
        return self

    @model_validator(mode="after")
    def _once_needs_sums(self) -> LossConfig:
        if self.trajectory_weight == "once":
            if self.loss_calculater == "CrossEntropy":
                raise ValueError("trajectory_weight once scales advantages, which CrossEntropy does not use")
            if self.loss_calculater == "GSPO" or not (self.token_level_loss or self.skip_length_normalization):
                raise ValueError("trajectory_weight once: this aggregation already weighs each sample once (the "
                                 "token mean of each sequence); it applies to token sums (token_level_loss true, "
                                 "or skip_length_normalization true)")
        return self

    @property
    def has_band(self) -> bool:
        """Whether policy losses drop the tokens whose ratio left the band (see ``losses._out_of_band``)."""
        return self.strict_in_bound or self.importance_weight_cap_ratio is not None

    def advisories(self) -> list[str]:
        """One line per option that this loss ignores, or that its authors recommend against (``agentrl train``
        logs them at start-up); only options given explicitly count as ignored."""
        notes: list[str] = []
        explicit = self.model_fields_set
        name = self.loss_calculater
        if name == "GSPO":
            ignored = [flag(field, True) for field in ("token_level_loss", "skip_length_normalization")
                       if field in explicit and getattr(self, field)]
            if ignored:
                notes.append(f"{flag('loss_calculater', name)}: {' and '.join(ignored)} ignored: GSPO is "
                             "sequence-level (each sequence's token mean, averaged over the step's sequences)")
        if name == "CrossEntropy":
            ignored = [flag(field, getattr(self, field)) for field in RATIO_FLAGS if field in explicit]
            if ignored:
                notes.append(f"{flag('loss_calculater', name)}: {', '.join(ignored)} ignored: supervised "
                             "training has no importance ratio")
        recipe = RECIPES.get(name, {})
        deviations = [flag(field, getattr(self, field)) for field, value in recipe.items()
                      if getattr(self, field) != value]
        if deviations:
            notes.append(f"{flag('loss_calculater', name)} with {', '.join(deviations)}: its authors recommend "
                         f"{' '.join(flag(field, value) for field, value in recipe.items())}")
        return notes
