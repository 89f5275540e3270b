"""Inference (docs/inference-protocol.md): the SGLang client, the ``agentrl engine`` server and the embedded model.

Light imports only here; the torch-based parts are imported from their modules:
``agentrl.inference.embedded_model.default_model_path``, ``agentrl.inference.tiny_model.build_tiny_model``,
``agentrl.inference.consistency.logprob_mismatch``, ``agentrl.inference.engine.InferenceEngine`` and
``agentrl.inference.process.EngineProcess`` (run ``agentrl engine`` as a subprocess).
"""

from agentrl.inference.client import GenerateResult, InferenceRequestError, InferenceServiceError, SGLangClient
from agentrl.inference.openai_pool import AllModelsFailed, ModelEndpoint, OpenAIPool
from agentrl.inference.protocol import SamplingParams

__all__ = [
    "AllModelsFailed", "GenerateResult", "InferenceRequestError", "InferenceServiceError", "ModelEndpoint",
    "OpenAIPool", "SGLangClient", "SamplingParams",
]
