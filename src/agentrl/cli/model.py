"""`agentrl model default [--vision]`: print the path of the embedded model (converted once from the bundled GGUF),
or of the embedded vision-language model (built once from it: :mod:`agentrl.inference.embedded_vision_model`).
`agentrl model merge ADAPTER --out DIR`: a LoRA adapter (e.g. a ``--use_peft`` checkpoint) merged into its base."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="the embedded model")
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    default = actions.add_parser(
        "default", help="print the cached Hugging Face directory of SmolLM2-135M-Instruct (converting it once)")
    default.add_argument("--vision", action="store_true",
                         help="the embedded vision-language model instead: SmolLM2-135M-Instruct with a random vision "
                              "tower of its own, a Qwen2.5-VL (built once; --model embedded-vision of agentrl run)")
    default.set_defaults(func=run)
    merge = actions.add_parser(
        "merge", help="merge a LoRA adapter directory (e.g. a --use_peft checkpoint) into its base model",
        description="Write ADAPTER (a PEFT adapter directory: adapter_config.json + adapter_model.safetensors) "
                    "merged into its base model as a plain Hugging Face model directory, loadable by transformers, "
                    "SGLang, `agentrl eval` and AutoRL-Bench's /submit.")
    merge.add_argument("adapter", help="the adapter directory")
    merge.add_argument("--out", required=True, help="where to write the merged model")
    merge.add_argument("--base_model", default=None,
                       help="base model directory (default: base_model_name_or_path of the adapter's config)")
    merge.set_defaults(func=run_merge)


def run(args: argparse.Namespace) -> int:
    from agentrl.inference.embedded_model import EmbeddedModelError, default_model_path
    from agentrl.inference.embedded_vision_model import default_vision_model_path

    try:
        print(default_vision_model_path() if args.vision else default_model_path())
    except EmbeddedModelError as error:
        print(f"error: {error}")
        return 1
    return 0


def run_merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from agentrl.training.lora import LoraError, merge_adapter_dir

    try:
        base = merge_adapter_dir(args.adapter, Path(args.out), args.base_model)
    except LoraError as error:
        print(f"error: {error}")
        return 1
    print(f"merged {args.adapter} into {base}: {args.out}")
    return 0
