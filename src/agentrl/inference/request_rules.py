"""SGLang's rules for one generation request, as the engine applies them: what it refuses, how greedy is normalised,
which tokens and strings stop it, its finish reason and the returned text (references: SGLang's
``SamplingParams.normalize``/``verify``, ``Req.check_finished`` and the detokenizer's stop trimming)."""

from __future__ import annotations

from collections.abc import Callable

from agentrl.inference.batching import RequestSampling
from agentrl.inference.protocol import BadRequest, FinishReason, SamplingParams
from agentrl.inference.sampling import GREEDY_EPS


def check_supported(params: SamplingParams) -> None:
    """Refuse what the engine does not implement (SGLang's repetition_penalty)."""
    if params.repetition_penalty != 1.0:
        raise BadRequest(f"repetition_penalty {params.repetition_penalty} is not supported by the agentrl "
                         "engine (only 1.0); use presence_penalty / frequency_penalty")


def validate(input_ids: list[int], params: SamplingParams, vocab_size: int, context_length: int | None,
             max_total_tokens: int) -> None:
    """:class:`BadRequest` for token ids outside the vocabulary, a request longer than the model's context or than
    the KV cache, or an unsupported parameter."""
    check_supported(params)
    bad = [i for i in input_ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"input_ids contains {len(bad)} token id(s) outside the vocabulary [0, "
                         f"{vocab_size}): {bad[:5]}")
    for token in params.stop_token_ids or []:
        if not 0 <= token < vocab_size:
            raise BadRequest(f"stop_token_ids contains {token}, outside the vocabulary [0, {vocab_size})")
    total = len(input_ids) + params.max_new_tokens
    if context_length and total > context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens."
            f" You requested a total of {total} tokens: {len(input_ids)} tokens from the input and "
            f"{params.max_new_tokens} tokens for the completion.")
    if total > max_total_tokens:
        raise BadRequest(f"the request needs {total} tokens of KV cache but the engine holds at most "
                         f"{max_total_tokens} (raise --max_total_tokens)")


def stop_token_ids(params: SamplingParams, eos_token_ids: set[int]) -> list[int]:
    """The tokens that end the request: the model's end-of-sequence ids and the request's own."""
    if params.ignore_eos:  # as in SGLang: ignore_eos also disables stop_token_ids
        return []
    return sorted(eos_token_ids | set(params.stop_token_ids or []))


def request_sampling(params: SamplingParams) -> RequestSampling:
    """The batcher's sampling values of a request (greedy normalised to ``top_k = 1``, as SGLang)."""
    penalties = {"presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty}
    if params.temperature < GREEDY_EPS or params.top_k == 1:
        return RequestSampling(temperature=1.0, top_k=1, seed=params.sampling_seed, **penalties)
    return RequestSampling(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
                           min_p=params.min_p, seed=params.sampling_seed, **penalties)


def stop_string_matcher(tokenizer, stops: list[str]) -> Callable[[list[int]], str | None] | None:
    """A function telling which stop string (if any) the end of the generated tokens contains."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    window = max(len(s) for s in stops) + 1  # a token is at least one character

    def matched(token_ids: list[int]) -> str | None:
        tail = tokenizer.decode(token_ids[-window:])
        return next((s for s in stops if s in tail), None)

    return matched


def finish_reason(tokens: list[int], params: SamplingParams, stop_ids: list[int],
                  matcher: Callable[[list[int]], str | None] | None) -> FinishReason:
    """Same precedence as SGLang's ``Req.check_finished``: length, then stop token, then stop string."""
    if len(tokens) >= params.max_new_tokens:
        return FinishReason(type="length", length=params.max_new_tokens)
    if tokens and tokens[-1] in stop_ids:
        return FinishReason(type="stop", matched=tokens[-1])
    matched = matcher(tokens) if matcher and tokens else None
    if matched is not None:
        return FinishReason(type="stop", matched=matched)
    return FinishReason(type="abort", message="generation ended without reaching a stop condition")


def output_text(tokenizer, output_ids: list[int], finish: FinishReason, params: SamplingParams) -> str:
    """The returned text: without the matched stop token or stop string unless ``no_stop_trim``."""
    ids = output_ids
    trim = not params.no_stop_trim
    if trim and isinstance(finish.matched, int) and ids:
        ids = ids[:-1]  # SGLang drops the matched stop token from the text
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if trim and isinstance(finish.matched, str):
        position = text.find(finish.matched)
        text = text[:position] if position >= 0 else text
    return text
