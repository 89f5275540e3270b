"""`agentrl model default`: print the path of the embedded model (converted once from the bundled GGUF)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="the embedded model")
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    default = actions.add_parser(
        "default", help="print the cached Hugging Face directory of SmolLM2-135M-Instruct (converting it once)")
    default.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentrl.inference.embedded_model import EmbeddedModelError, default_model_path

    try:
        print(default_model_path())
    except EmbeddedModelError as error:
        print(f"error: {error}")
        return 1
    return 0
