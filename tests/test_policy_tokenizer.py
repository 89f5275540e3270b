"""``policy_tokenizer`` gives what ``AutoTokenizer`` gives, without torch where it loads the generic class itself.

The shortcut is only sound while transformers' own tables say ``AutoTokenizer`` honours a declared
``TokenizersBackend`` for the model types it is taken for: that is checked here against transformers' tables, so an
upgrade that changes them fails this test instead of tokenizing differently in samplers and engines.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.inference.embedded_model import default_tokenizer_path
from agentrl.inference.policy_tokenizer import GENERIC_CLASS, GENERIC_MODEL_TYPES, loads_as_generic, policy_tokenizer

TEXTS = ["", "hello world", "  two  spaces\tand a tab\n", "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓ 漢字",
         "def f(x):\n    return x * 2  # code", "1234567890 + 0.5e-3"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def test_transformers_loads_a_declared_generic_tokenizer_as_such_for_the_shortcuts_model_types() -> None:
    from transformers.models.auto import tokenization_auto as auto

    for model_type in GENERIC_MODEL_TYPES:
        assert model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, model_type
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) in (None, GENERIC_CLASS), model_type


@pytest.mark.parametrize("which", ["tokenizer alone", "tiny model"])
def test_the_shortcut_tokenizes_and_renders_chats_exactly_as_auto_tokenizer(which: str, tiny_model_dir: Path) -> None:
    path = default_tokenizer_path() if which == "tokenizer alone" else tiny_model_dir
    assert loads_as_generic(path)
    ours, auto = policy_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens and ours.eos_token_id == auto.eos_token_id
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False), text
    for end in range(1, len(MESSAGES) + 1):
        for tokenize in (False, True):
            rendered = [tokenizer.apply_chat_template(MESSAGES[:end], add_generation_prompt=True, tokenize=tokenize,
                                                      return_dict=False) for tokenizer in (ours, auto)]
            assert rendered[0] == rendered[1] and len(rendered[0]) > 0, (end, tokenize)


def test_a_process_that_only_tokenizes_does_not_import_torch(tiny_model_dir: Path) -> None:
    code = ("import sys; from agentrl.inference.policy_tokenizer import policy_tokenizer; "
            f"t = policy_tokenizer({str(tiny_model_dir)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"


def _variant(tmp_path: Path, tiny_model_dir: Path, tokenizer: dict, config: dict | None) -> Path:
    """A copy of the tiny model's tokenizer files with ``tokenizer`` merged into its tokenizer_config.json and
    ``config`` (None: no config.json) as its config.json."""
    out = tmp_path / "variant"
    out.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, out / name)
    declared = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**declared, **tokenizer}))
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("tokenizer", "config", "generic"), [
    ({}, {"model_type": "llama"}, True),
    ({}, None, True),
    ({"tokenizer_class": "Qwen2Tokenizer"}, {"model_type": "qwen2"}, False),  # a class of its own
    ({}, {"model_type": "qwen2"}, False),  # transformers maps qwen2 to Qwen2Tokenizer
    ({}, {"model_type": "internlm2"}, False),  # on transformers' list of wrongly declared classes
    ({"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}, {"model_type": "llama"}, False),  # remote code
    ({}, {"model_type": "llama", "auto_map": {"AutoModel": "m.M"}}, False),
])
def test_only_what_auto_tokenizer_loads_as_the_generic_class_takes_the_shortcut(
        tokenizer: dict, config: dict | None, generic: bool, tmp_path: Path, tiny_model_dir: Path) -> None:
    assert loads_as_generic(_variant(tmp_path, tiny_model_dir, tokenizer, config)) is generic


def test_an_adapter_directory_goes_through_auto_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """AutoConfig follows a LoRA adapter to its base model, whose type may have a tokenizer class of its own."""
    adapter = _variant(tmp_path, tiny_model_dir, {}, None)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    assert not loads_as_generic(adapter)


def test_a_hub_name_a_missing_directory_or_unreadable_configuration_goes_through_auto_tokenizer(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    assert not loads_as_generic(Path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    broken = _variant(tmp_path, tiny_model_dir, {}, {"model_type": "llama"})
    (broken / "config.json").write_text("{not json")
    assert not loads_as_generic(broken)
    (broken / "config.json").unlink()
    (broken / "tokenizer.json").unlink()
    assert not loads_as_generic(broken)
