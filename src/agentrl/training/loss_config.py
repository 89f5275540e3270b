"""The loss options: one pydantic model, the ``loss`` part of the trainer's configuration.

Each field is a flag of ``agentrl train`` under its own name (``--loss_calculater``, ``--epsilon``...: the original's
names and defaults). The formulas are in :mod:`agentrl.training.losses`, whose registry holds one function per
``LossName``. This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossName = Literal["GRPO", "MINIRL", "GSPO", "CrossEntropy"]
"""The losses of ``agentrl.training.losses.LOSSES`` (``--loss_calculater``'s choices)."""


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

    @model_validator(mode="after")
    def _decay_needs_band(self) -> LossConfig:
        if self.out_of_date_decay is not None and not self.has_band:
            raise ValueError("out_of_date_decay needs a band: set importance_weight_cap_ratio or strict_in_bound")
        return self

    @property
    def has_band(self) -> bool:
        """Whether policy losses drop the tokens whose ratio left the band (see ``losses._out_of_band``)."""
        return self.strict_in_bound or self.importance_weight_cap_ratio is not None
