"""The served policy, checked after every publish.

A weight or adapter update can fail silently: the service answers success and goes on serving other weights (an
update that never reached the model, an adapter listed as loaded that changes nothing). Its samples are then
trained as if the trainer's policy had made them. So after the services have loaded a published version, each
one that reported success scores a fixed token sequence (:data:`PROBE_TEXT`) through SGLang's ``/generate``
(``return_logprob``, ``logprob_start_len`` 0: ``meta_info.input_token_logprobs``; after an adapter publish the
request names the adapter, at temperature 1) and its logprobs are compared with the trainer's own of the same
tokens (:func:`trainer_logprobs`: fp32 LM head, autocast off, dropout off). A service fails the check when

* the mean absolute difference over the sequence exceeds ``max_mean_abs_diff`` (``--policy_probe_max_diff``);
* after a full-weight publish, the response's ``weight_version`` is not the published version;
* it refuses the request (e.g. the adapter is not loaded) or its answer lacks the prompt logprobs.

A failure is logged as an error naming the service, counted in the step's metrics (``policy_probe_failures``,
next to ``policy_probe_max_mean_abs_diff``) and stored on the service's ``InferenceService.policy_probe``, which
keeps samplers off it until a later check passes or it registers afresh (a restarted engine). A service that could
not be reached is only logged: the samplers' own connection checks handle it.

Bound (``--policy_probe_max_diff``, default 0.1), from ``bench/policy_probe.py`` on the embedded model
(SmolLM2-135M, the sequence below: 66 scored tokens), trainer logprobs in fp32, CPU (torch 2.13):

============================================  ==================  =================
served logprobs                               mean |difference|   max |difference|
============================================  ==================  =================
``agentrl engine``, fp32                      9.6e-06             1.6e-05
``agentrl engine``, bf16                      0.038               0.17
fp32, weights moved by 1e-4 of their scale    0.00077             0.0048
fp32, weights moved by 1e-3 of their scale    0.0077              0.048
fp32, weights moved by 1e-2 of their scale    0.077               0.40
============================================  ==================  =================

0.1 is 2.6 times the bf16 figure, so bf16 serving passes; 0.001 (100 times the fp32 figure) suits fp32 serving
only. The last rows show what the check cannot see: a service whose weights are less than about 1% (bf16 bound)
or 0.01% (fp32 bound) off. A stale service drifts further with every version it misses, and after a full-weight
publish the ``weight_version`` check catches one that did not take the version at all.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from agentrl.store.models import PolicyProbe
from agentrl.training.logprobs import model_token_logprobs

logger = logging.getLogger(__name__)

PROBE_TEXT = ("The committee met on Tuesday to review the budget. After a short discussion, they agreed that "
              "17 + 25 = 42 and approved it.\ndef area(r):\n    return 3.14159 * r * r\nQ: What is the capital of "
              "France? A: Paris.")
"""The sequence every service scores after a publish: prose, arithmetic, code and a question (varied contexts)."""

def probe_token_ids(tokenizer: Any, max_positions: int | None = None) -> list[int]:
    """:data:`PROBE_TEXT` in the policy's tokens (cut to the model's context if it is shorter)."""
    ids = list(tokenizer.encode(PROBE_TEXT))
    return ids[:max_positions] if max_positions else ids


def trainer_logprobs(model: nn.Module, token_ids: list[int], device: torch.device) -> list[float]:
    """The trainer's logprobs of ``token_ids[1:]`` (every rank must call it: sharded layers gather in the forward).

    No autocast and eval mode (no dropout); the LM head runs in fp32 (``model_token_logprobs``). The model's
    training mode is restored."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=device)
            return model_token_logprobs(model, ids)[0, 1:].float().cpu().tolist()
    finally:
        model.train(training)


async def check_service(base_url: str, token_ids: list[int], expected: list[float], *, version: int,
                        adapter: str | None, max_mean_abs_diff: float, retries: int = 1) -> PolicyProbe | None:
    """Have the service at ``base_url`` score ``token_ids`` and judge it (``None``: it could not be reached)."""
    from agentrl.inference.client import InferenceRequestError, InferenceServiceError, SGLangClient

    # Prefill only (SGLang scores a prompt this way): a generated token would queue the probe behind the requests
    # the load held back, whose prompts the flushed cache prefills again (main job on CPU, fresh clones: the probe's
    # median 0.83 s a publish before, 0.67 s after).
    params = {"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    async with SGLangClient(base_url, max_retries=retries) as client:
        try:
            result = await client.generate(token_ids, params, lora_path=adapter, logprob_start_len=0)
        except InferenceRequestError as error:
            return PolicyProbe(version=version, ok=False, error=f"refused the probe: {error.cause}")
        except InferenceServiceError as error:
            logger.warning("policy probe of %s after publishing version %d: %s", base_url, version, error)
            return None
    served = result.input_token_logprobs[1:]
    if len(served) != len(expected) or any(value is None for value in served):
        return PolicyProbe(version=version, ok=False, error=(
            f"returned {len(result.input_token_logprobs)} prompt logprobs for {len(token_ids)} tokens: does it "
            "support logprob_start_len?"))
    gaps = [abs(s - e) for s, e in zip(served, expected, strict=True)]
    mean, worst = math.fsum(gaps) / max(len(gaps), 1), max(gaps, default=0.0)
    errors = []
    if not mean <= max_mean_abs_diff:  # NaN fails too
        errors.append(f"mean |served - trainer| logprob {mean:.3g} exceeds {max_mean_abs_diff:g} (max {worst:.3g})")
    if adapter is None and result.weight_version != str(version):
        errors.append(f"serves weight_version {result.weight_version!r}, not {version}")
    return PolicyProbe(version=version, ok=not errors, mean_abs_diff=mean, max_abs_diff=worst,
                       error="; ".join(errors) or None)


def probe_metrics(probes: dict[str, PolicyProbe]) -> dict[str, float]:
    """The step's figures: services checked, how many failed, the largest mean difference measured."""
    values = {"policy_probe_services": float(len(probes)),
              "policy_probe_failures": float(sum(not p.ok for p in probes.values()))}
    measured = [p.mean_abs_diff for p in probes.values() if p.mean_abs_diff is not None]
    if measured:
        values["policy_probe_max_mean_abs_diff"] = max(measured)
    return values
