"""`agentrl model default`: print the path of the embedded model (converted once from the bundled GGUF).
`agentrl model merge ADAPTER --out DIR`: a LoRA adapter (e.g. a ``--use_peft`` checkpoint) merged into its base."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="the embedded model")
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    default = actions.add_parser(
        "default", help="print the cached Hugging Face directory of SmolLM2-135M-Instruct (converting it once)")
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

    try:
        print(default_model_path())
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
