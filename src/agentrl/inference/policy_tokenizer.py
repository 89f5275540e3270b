"""The policy's tokenizer, loaded as ``AutoTokenizer`` loads it, without importing torch where that gives the same.

``AutoTokenizer`` imports transformers' configuration classes, and those import torch: ~1.9 CPU-seconds and ~170 MB
in every process that only tokenizes (a sampler, an evaluation, ``agentrl sft upload``, the dashboard). For a model
directory whose ``tokenizer_config.json`` declares the generic ``TokenizersBackend`` class, with no remote code,
whose ``config.json`` names no model type or one that transformers maps to no tokenizer class of its own, and that
is no LoRA adapter (whose base model's type would count), ``AutoTokenizer.from_pretrained`` returns exactly
``TokenizersBackend.from_pretrained(path)``: this module calls that directly. Every other model, and every name
that is not a local directory, goes through ``AutoTokenizer``.
Engines, samplers and evaluations all load through :func:`policy_tokenizer`, so they tokenize alike by construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASS = "TokenizersBackend"
GENERIC_MODEL_TYPES = frozenset({"llama"})
"""Model types for which ``AutoTokenizer`` honours a declared ``TokenizersBackend``: no tokenizer class of their own
in transformers' table and not on its list of checkpoints with a wrong declared class (checked against those
tables by ``tests/test_policy_tokenizer.py``). A directory without ``config.json`` (a tokenizer alone) counts too."""


def policy_tokenizer(model_name_or_path: str | Path | None = None) -> Any:
    """The tokenizer (and chat template) of ``model_name_or_path``; ``None``: the embedded model's."""
    if model_name_or_path is None:
        from agentrl.inference.embedded_model import default_tokenizer_path

        model_name_or_path = default_tokenizer_path()
    path = str(model_name_or_path)
    if loads_as_generic(Path(path)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def loads_as_generic(path: Path) -> bool:
    """Whether ``AutoTokenizer`` would load the directory ``path`` as a plain ``TokenizersBackend``."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    except (OSError, ValueError):
        return False
    if not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict):
        return False
    model_type = model_config.get("model_type")
    return (tokenizer_config.get("tokenizer_class") == GENERIC_CLASS and (path / "tokenizer.json").is_file()
            and "auto_map" not in tokenizer_config and "auto_map" not in model_config
            and (model_type is None or model_type in GENERIC_MODEL_TYPES)
            and not (path / "adapter_config.json").exists())  # AutoConfig would read the base model's type
