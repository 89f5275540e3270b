"""Inference (docs/inference-protocol.md): the SGLang client, the ``agentrl engine`` server and the embedded model.

Light imports only here (the OpenAI pool, which imports ``openai``, on first use); the torch-based parts are
imported from their modules:
``agentrl.inference.embedded_model.default_model_path``, ``agentrl.inference.tiny_model.build_tiny_model``,
``agentrl.inference.consistency.logprob_mismatch``, ``agentrl.inference.engine.InferenceEngine`` and
``agentrl.inference.process.EngineProcess`` (run ``agentrl engine`` as a subprocess).
"""

from typing import Any

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient
from agentrl.inference.protocol import SamplingParams

_OPENAI_POOL = ("AllModelsFailed", "ModelEndpoint", "OpenAIPool")

__all__ = [
    "AllModelsFailed", "GenerateResult", "InferenceRequestError", "InferenceServiceError", "ModelEndpoint",
    "OpenAIPool", "SGLangClient", "SamplingParams",
]


def __getattr__(name: str) -> Any:
    """The OpenAI pool's names, imported when first asked for (``openai`` takes ~0.4 s to import)."""
    if name in _OPENAI_POOL:
        from agentrl.inference import openai_pool

        return getattr(openai_pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
