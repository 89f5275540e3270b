"""One trajectory, token in / token out: generate, parse tool calls, call tools, append the token delta, repeat.

Every LLM call is noted in the trajectory's ``CallLog`` as a ``DispatchedSamplingTask`` before it is sent
(``running``) and finished with its output ids, per-token logprobs, weight version (the run's policy version: a
service's non-numeric version, such as SGLang's ``"default"``, is the initial policy 0) and timing; the tool stage
may re-label it ``formaterror``, ``toolfailed`` or ``repeaterror``. The sampler writes the log in one command when
the trajectory ends (``agentrl.store.call_log``). Every LLM and tool call first passes the lease's fence
(``SlotLeases.fence``), which costs a database round trip only when the lease is not known to hold for long enough.
The trajectory ends with an answer, or with ``turns_limit_error``, ``length_limit_error``, ``repetition_error`` or
``failed_error`` (a request the service rejects, or an aborted generation). When no live inference service answers
(:class:`NoInferenceService`, an infrastructure failure) the call is finished ``failed`` and the error propagates: the
attempt is not the policy's fault and is not scored. The same holds for a database error while choosing the service
(the pool syncs its load counters with the database).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pymongo.errors import PyMongoError
from transformers import PreTrainedTokenizerBase

from agentrl.envs.pool import EnvPool
from agentrl.rollout.config import SamplerConfig
from agentrl.rollout.context import reset_context
from agentrl.rollout.conversation import TokenConversation
from agentrl.rollout.inference_pool import InferencePool, NoInferenceService
from agentrl.rollout.mcp_state import McpState, McpStateError
from agentrl.rollout.tool_parsers import NO_VERDICT_OUTCOMES, ToolParser, TrajectoryOutcome
from agentrl.scoring import AgentConfig, extract_answer
from agentrl.store import CallStatus, DispatchedSamplingTask, SlotLease, Store
from agentrl.store.call_log import CallLog
from agentrl.tools import ToolManager
from agentrl.trajectory.prompting import initial_messages
from agentrl.vision.images import ImageError, LoadedImage
from agentrl.vision.processor import VisionInputError, VisionProcessor

logger = logging.getLogger(__name__)

ANSWER = TrajectoryOutcome.ANSWER
TURNS_LIMIT = TrajectoryOutcome.TURNS_LIMIT_ERROR
LENGTH_LIMIT = TrajectoryOutcome.LENGTH_LIMIT_ERROR
REPETITION = TrajectoryOutcome.REPETITION_ERROR
FAILED = TrajectoryOutcome.FAILED_ERROR


@dataclass
class AgentResources:
    """What every trajectory of a sampler process shares."""

    store: Store
    tokenizer: PreTrainedTokenizerBase
    inference: InferencePool
    parser: ToolParser
    config: SamplerConfig
    tools: ToolManager | None = None
    agent_config: AgentConfig = field(default_factory=AgentConfig)
    envs: EnvPool | None = None
    """Environment servers, for Tasks that are environment episodes (``agentrl.rollout.episode``)."""
    vision: VisionProcessor | None = None
    """The policy's image tokens (a vision-language policy; None for a text model)."""

    @property
    def tool_specs(self) -> list[dict[str, Any]]:
        return self.tools.openai_tools() if self.tools is not None else []


@dataclass
class TrajectoryResult:
    outcome: TrajectoryOutcome
    final_answer: str | None
    num_turns: int
    num_branches: int
    policy_version: int | None
    error: str | None = None
    env: dict[str, Any] | None = None
    """An environment episode's result: ``{name, data_idx, reward, score, success, steps}`` (the score is the
    reward times the environment's ``reward_scale``)."""
    final_state: Any = None
    """A stateful MCP episode's final state (its ``final`` tool's result), for the scorer."""


def call_seed(seed: int, call_id: str) -> int:
    """A per-call sampling seed: reproducible for a run's ``--seed``, different for every Task, slot, attempt and
    turn (so identical prompts in one group still get different samples)."""
    digest = hashlib.blake2b(f"{seed}:{call_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@dataclass
class Generated:
    """One completed LLM call."""

    call_id: str
    text: str
    output_ids: list[int]
    version: int | None


class GenerationFailed(Exception):
    """The service rejected the request or aborted the generation: the trajectory ends as ``failed_error``."""


class PlaceholderGenerated(Exception):
    """A vision-language policy generated a picture's placeholder token: the trajectory ends as
    ``vision_token_error`` (another turn on those ids would be refused, and no trainer can forward them)."""


@dataclass
class TurnState:
    """Where a trajectory stands between LLM calls: what the next call's prompt extends."""

    previous_call: str | None = None
    pending_delta: tuple[list[int], str] | None = None
    first_version: int | None = None
    branches: int = 1

    def appended(self, delta: Any) -> None:
        """Note the token delta appended after the last call (a new branch starts its prompt afresh)."""
        if delta.new_branch:
            self.branches += 1
            self.pending_delta = None
        else:
            self.pending_delta = (delta.delta_ids, delta.delta_text)

    def new_branch(self) -> None:
        self.branches += 1
        self.pending_delta = None


async def generate_turn(res: AgentResources, lease: SlotLease, calls: CallLog, conversation: TokenConversation,
                        turn: int, state: TurnState) -> Generated:
    """Log, send and finish turn ``turn``'s LLM call on ``conversation``'s prompt; ``GenerationFailed`` if the
    service rejects or aborts it; ``NoInferenceService`` / ``PyMongoError`` (infrastructure) propagate."""
    pending, sampling = state.pending_delta, res.config.rollout.sampling_params()
    call = DispatchedSamplingTask(
        id=f"{lease.record_id}#{turn}", record_id=lease.record_id, task_id=lease.task.id, turn=turn,
        branch=conversation.branch,
        input_ids=None if pending else list(conversation.prompt_ids),
        previous_call_id=state.previous_call if pending else None,
        prompt_delta_ids=pending[0] if pending else [],
        prompt_delta_text=pending[1] if pending else res.tokenizer.decode(conversation.prompt_ids),
        images=list(conversation.images), sampling_params=sampling)
    await res.store.slots.fence(lease)  # a retired attempt makes no LLM call (LeaseLost)
    calls.start(call)
    started = time.monotonic()
    params = dict(sampling)
    if res.config.rollout.seed is not None:
        params["sampling_seed"] = call_seed(res.config.rollout.seed, call.id)
    try:
        result, service_id = await res.inference.generate(conversation.prompt_ids, params,
                                                          conversation.image_data() or None)
    except (NoInferenceService, PyMongoError) as error:  # infrastructure: given back unscored by the caller
        calls.finish(call.id, CallStatus.FAILED, error=str(error), latency_s=time.monotonic() - started)
        raise
    except Exception as error:  # any other generation failure ends the trajectory as failed_error
        calls.finish(call.id, CallStatus.FAILED, error=str(error), latency_s=time.monotonic() - started)
        raise GenerationFailed(str(error)) from error
    if result.finish_reason == "abort":  # the service stopped the generation (shutdown, /abort_request)
        error = f"the inference service aborted the generation: {result.meta_info.get('finish_reason')}"
        calls.finish(call.id, CallStatus.FAILED, output_ids=result.output_ids,
                     output_logprobs=result.output_token_logprobs, error=error, latency_s=time.monotonic() - started)
        raise GenerationFailed(error)
    spans = result.policy_version_spans
    version = spans[0][0]  # the oldest: versions only grow while a call runs
    state.first_version = version if state.first_version is None else state.first_version
    calls.finish(
        call.id, CallStatus.COMPLETED, output_ids=result.output_ids, output_logprobs=result.output_token_logprobs,
        output_text=result.text, weight_version=version, weight_version_spans=spans if len(spans) > 1 else None,
        finish_reason=result.finish_reason, service_id=service_id, latency_s=time.monotonic() - started)
    state.previous_call = call.id
    if res.vision is not None and not res.vision.placeholder_ids.isdisjoint(result.output_ids):
        error = (f"the model generated a picture's placeholder token (ids {sorted(res.vision.placeholder_ids)}) "
                 "that no picture stands behind")
        calls.relabel(call.id, CallStatus.FORMATERROR, error=error)
        raise PlaceholderGenerated(error)
    return Generated(call.id, result.text, list(result.output_ids), version)


async def run_trajectory(res: AgentResources, lease: SlotLease, calls: CallLog) -> TrajectoryResult:
    """Roll out the trajectory of ``lease``'s slot, logging every call in ``calls``; returns how it ended. A Task
    with ``metadata.mcp_state`` gets its own state on a stateful MCP server (:mod:`agentrl.rollout.mcp_state`)."""
    task = lease.task
    mcp_state = McpState.of(task.metadata, lease.record_id)
    if mcp_state is None:
        return await _roll_out(res, lease, calls, None)
    if res.tools is None:
        raise McpStateError("the Task keeps its state on an MCP server (metadata.mcp_state) but the sampler has no "
                            "tools: give --mcp_config")
    try:
        await mcp_state.call(res.tools, "reset", res.config.rollout.tool_timeout)
    except McpStateError as error:
        return TrajectoryResult(TrajectoryOutcome.ENV_START_ERROR, None, 0, 1, None, error=str(error))
    result = await _roll_out(res, lease, calls, mcp_state)
    if result.outcome not in NO_VERDICT_OUTCOMES:
        try:
            result.final_state = await mcp_state.call(res.tools, "final", res.config.rollout.tool_timeout)
        except McpStateError as error:
            result.outcome, result.error = TrajectoryOutcome.ENV_ERROR, str(error)
    return result


async def _roll_out(res: AgentResources, lease: SlotLease, calls: CallLog, mcp_state: McpState | None
                    ) -> TrajectoryResult:
    cfg, task = res.config.rollout, lease.task
    tools = mcp_state.visible_tools(res.tool_specs) if mcp_state is not None else res.tool_specs
    messages, template_tools = initial_messages(
        query=task.query, answer_schema=task.answer_schema, system_prompt=task.system_prompt,
        tools=tools, tokenizer=res.tokenizer, query_prompt=cfg.query_prompt, images=task.images)
    try:
        pictures = await res.store.images.get_many(task.images) if task.images else {}
        conversation = TokenConversation(res.tokenizer, messages, template_tools, vision=res.vision,
                                         pictures=pictures)
    except (ImageError, VisionInputError) as error:  # a picture gone from the database, or a text-only policy
        return TrajectoryResult(FAILED, None, 0, 1, None, error=f"the Task's images: {error}")
    state = TurnState()
    outputs_seen: list[str] = []
    for turn in range(cfg.max_turns):
        try:
            generated = await generate_turn(res, lease, calls, conversation, turn, state)
        except GenerationFailed as error:
            return TrajectoryResult(FAILED, None, turn, state.branches, state.first_version, error=str(error))
        except PlaceholderGenerated as error:
            return TrajectoryResult(TrajectoryOutcome.VISION_TOKEN_ERROR, None, turn + 1, state.branches,
                                    state.first_version, error=str(error))
        text = generated.text

        answer = extract_answer(text, task.answer_schema)
        if answer:
            return TrajectoryResult(ANSWER, answer, turn + 1, state.branches, state.first_version)

        repeats = outputs_seen.count(text.strip())
        outputs_seen.append(text.strip())
        if repeats >= 1:
            calls.relabel(generated.call_id, CallStatus.REPEATERROR, error=f"output repeated {repeats} time(s)")
            if cfg.repetition_early_stop_times > 0 and repeats + 1 >= cfg.repetition_early_stop_times:
                return TrajectoryResult(REPETITION, None, turn + 1, state.branches, state.first_version)

        new_messages = await _tool_stage(res, lease, calls, generated.call_id, text, repeated=repeats >= 1,
                                         mcp_state=mcp_state, pictures=conversation.pictures)
        state.appended(conversation.append(generated.output_ids, text, new_messages))
        if len(conversation.prompt_ids) + cfg.max_new_tokens > cfg.max_prompt_tokens:
            if cfg.new_context == "disabled":
                return TrajectoryResult(LENGTH_LIMIT, None, turn + 1, state.branches, state.first_version)
            await reset_context(conversation, cfg.new_context, task.query, res.agent_config)
            state.new_branch()
            if len(conversation.prompt_ids) + cfg.max_new_tokens > cfg.max_prompt_tokens:
                return TrajectoryResult(LENGTH_LIMIT, None, turn + 1, state.branches, state.first_version)
    return TrajectoryResult(TURNS_LIMIT, None, cfg.max_turns, state.branches, state.first_version)


async def _tool_stage(res: AgentResources, lease: SlotLease, log: CallLog, call_id: str, text: str, *,
                      repeated: bool, mcp_state: McpState | None = None,
                      pictures: dict[str, LoadedImage] | None = None) -> list[dict[str, Any]]:
    """Parse and run the tool calls of ``text``; returns the messages to append (one per call: its result or why
    it could not run). The call is labelled with the worst status of its tool calls (``formaterror`` first).
    Each tool call is fenced (``SlotLeases.fence``): a retired attempt runs no (possibly non-idempotent) tool call.
    A vision-language policy also sees the results' pictures: stored in GridFS, added to ``pictures`` and shown
    after the result's text."""
    parsed = res.parser.parse(text)
    if not parsed.calls:
        return []
    calls, results, messages = [], [], []
    statuses: set[CallStatus] = set()
    seeing = res.vision is not None and pictures is not None
    for index, tool_call in enumerate(parsed.calls):
        call_ref = f"{call_id}.{index}"
        calls.append({"id": call_ref, "name": tool_call.name, "arguments": tool_call.arguments,
                      "error": tool_call.error, "raw": tool_call.raw})
        shown: list[str] = []  # the result's pictures (sha256), for a vision-language policy
        if tool_call.error is not None:
            status, content, error, elapsed = CallStatus.FORMATERROR, tool_call.error, tool_call.error, 0.0
        elif res.tools is None:
            error = "no tools are available in this environment; answer directly"
            status, content, elapsed = CallStatus.FORMATERROR, error, 0.0
        elif mcp_state is not None and tool_call.name in mcp_state.hidden:
            error = f"Unknown tool {tool_call.name!r}."
            status, content, elapsed = CallStatus.FORMATERROR, error, 0.0
        else:
            await res.store.slots.fence(lease)
            arguments = mcp_state.arguments(tool_call.arguments) if mcp_state is not None else tool_call.arguments
            result = await res.tools.call_tool(tool_call.name, arguments, timeout=res.config.rollout.tool_timeout,
                                               images=seeing)
            status = CallStatus.COMPLETED if result.ok else CallStatus(str(result.status))
            content, error, elapsed = result.text, result.error, result.elapsed_s
            for image in result.images:
                await res.store.images.put(image)
                pictures[image.sha256] = image
            shown = [image.sha256 for image in result.images]
        if status != CallStatus.COMPLETED:
            statuses.add(status)
        results.append({"id": call_ref, "name": tool_call.name, "status": "ok" if status == CallStatus.COMPLETED
                        else str(status), "content": content, "error": error, "elapsed_s": elapsed} | (
                            {"images": shown} if shown else {}))
        messages.append({"role": "tool", "name": tool_call.name or "invalid_call", "content": [
            {"type": "text", "text": content}, *({"type": "image", "image": sha256} for sha256 in shown)]
            if shown else content})
    update = {"tool_calls": calls, "tool_results": results}
    worst = next((s for s in (CallStatus.FORMATERROR, CallStatus.TOOLFAILED) if s in statuses), None)
    if worst is not None and not repeated:
        error = "; ".join(r["error"] for r in results if r["status"] == str(worst) and r["error"])
        log.relabel(call_id, worst, error=error, **update)
    else:
        log.annotate(call_id, **update)
    return messages
