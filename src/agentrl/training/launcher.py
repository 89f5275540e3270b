"""The settings of an ``accelerate launch --config_file`` config, which reach the trainer as environment variables.

accelerate only starts the ranks here (the trainer shards the model itself), so each config field the trainer
honours is read from the variable accelerate sets for it and applied to the ``TrainConfig``:

=====================================  ===============================  =========================================
config field                           variable                         trainer setting
=====================================  ===============================  =========================================
``mixed_precision``                    ``ACCELERATE_MIXED_PRECISION``   ``bf16`` (``bf16``: true, ``no``: false)
``fsdp_activation_checkpointing``      ``FSDP_ACTIVATION_CHECKPOINTING``  ``gradient_checkpointing``
``fsdp_reshard_after_forward``         ``FSDP_RESHARD_AFTER_FORWARD``   ``reshard_after_forward``
``fsdp_cpu_ram_efficient_loading``     ``FSDP_CPU_RAM_EFFICIENT_LOADING``  ``cpu_ram_efficient_loading``
``parallelism_config_tp_size``         ``PARALLELISM_CONFIG_TP_SIZE``   ``tp_size``
``parallelism_config_dp_shard_size``   ``PARALLELISM_CONFIG_DP_SHARD_SIZE``  checked: × tp_size = processes
=====================================  ===============================  =========================================

A flag given explicitly must agree with the config. Settings the trainer cannot honour are refused:
``mixed_precision: fp16``/``fp8``, ``fsdp_offload_params: true`` and ``fsdp_version: 1`` (it always uses FSDP2).
"""

from __future__ import annotations

import os
from typing import Any

from agentrl.training.config import TrainConfig


class LaunchConfigError(ValueError):
    """The accelerate config asks for something the trainer cannot do, or contradicts a flag."""


BOOLEAN_FIELDS = {
    "FSDP_ACTIVATION_CHECKPOINTING": ("fsdp_activation_checkpointing", "gradient_checkpointing"),
    "FSDP_RESHARD_AFTER_FORWARD": ("fsdp_reshard_after_forward", "reshard_after_forward"),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
}


def apply_launch_config(config: TrainConfig, environ: dict[str, str] | None = None) -> TrainConfig:
    """``config`` with the accelerate config's settings applied (unchanged outside ``accelerate launch``)."""
    env = os.environ if environ is None else environ
    settings: dict[str, tuple[str, Any]] = {}  # trainer field -> (config field, value)
    precision = env.get("ACCELERATE_MIXED_PRECISION")
    if precision is not None:
        if precision not in ("no", "bf16"):
            raise LaunchConfigError(f"the accelerate config's mixed_precision {precision!r} is not supported: use "
                                    "bf16 (bf16 compute, fp32 master weights and LM head) or no")
        settings["bf16"] = ("mixed_precision", precision == "bf16")
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        if env.get("FSDP_VERSION", "2") != "2":
            raise LaunchConfigError(f"the accelerate config's fsdp_version {env['FSDP_VERSION']} is not supported: "
                                    "the trainer shards with FSDP2 (set fsdp_version: 2)")
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            raise LaunchConfigError("the accelerate config's fsdp_offload_params: true is not supported (parameters "
                                    "stay on the GPU): set it to false, or use --gradient_checkpointing and more "
                                    "ranks to save memory")
        for variable, (field, setting) in BOOLEAN_FIELDS.items():
            if variable in env:
                settings[setting] = (field, env[variable].lower() == "true")
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") and "PARALLELISM_CONFIG_TP_SIZE" in env:
        settings["tp_size"] = ("parallelism_config_tp_size", int(env["PARALLELISM_CONFIG_TP_SIZE"]))
        dp_shard = env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE")
        tp_size = settings["tp_size"][1]
        if dp_shard is not None and "WORLD_SIZE" in env and int(dp_shard) * tp_size != int(env["WORLD_SIZE"]):
            raise LaunchConfigError(f"the accelerate config's parallelism_config_dp_shard_size {dp_shard} × "
                                    f"parallelism_config_tp_size {tp_size} is not the {env['WORLD_SIZE']} processes "
                                    "launched: the data-parallel size is num_processes / tp_size")
    update = {}
    for setting, (field, value) in settings.items():
        given = getattr(config, setting)
        if setting in config.model_fields_set and given is not None and given != value:
            raise LaunchConfigError(f"--{setting} {_flag(given)} disagrees with the accelerate config's {field} "
                                    f"({_flag(value)}): change one of them")
        update[setting] = value
    return config.model_copy(update=update)


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
