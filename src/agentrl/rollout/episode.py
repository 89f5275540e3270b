"""One environment episode as a trajectory: observation in, action out, token-exact, one instance per trajectory.

A Task whose metadata has ``env: {name, data_idx}`` is an episode of a stateful environment reached over the
AgentGym HTTP protocol (:mod:`agentrl.envs.client`). The episode:

1. closes the instances of earlier attempts of the same slot that were never closed (their sampler died), then
   creates an instance, records it on the Record (fenced by the lease), and resets it to task ``data_idx``;
2. renders the environment's instruction (system) and first observation (user) with the chat template; each turn
   the model generates, its action is parsed (:func:`agentrl.envs.actions.parse_action`) and stepped, and the
   observation is appended as the next user turn — the token delta, exactly as tool results are, so every call's
   prompt extends the previous prompt + output. Where the server draws each observation (``agentrl envs serve NAME
   --images``: an ``image`` field) a vision-language policy sees the picture before the observation's text (stored
   in GridFS, named in the calls' ``images``). A turn without an action is told so and stepped no further (the
   call is labelled ``formaterror``). Each call stores its step: ``env_step: {action, observation, reward, done}``,
   and for per-turn credit its ``step_reward`` (scaled by ``reward_scale``, as the score), ``done`` and the
   ``state_key`` of the state it acted in (the server's, else a hash of the observation it answered);
3. ends on ``done`` (outcome ``done``), the turn limit (the Task's ``env.max_turns`` capped by ``--max_turns``) or
   the context limit; the score is the episode's reward
   (the latest cumulative ``score`` where the server reports one, else the sum of step rewards) times the
   environment's ``reward_scale``;
4. closes the instance — also when cancelled (sampler shutdown) — and marks it closed on the Record.

Invariants: an instance is used by one attempt only; every instance recorded on a Record is closed by its attempt,
or by a later attempt of the slot once the lease of the dead one expired (or by the server's idle sweep). Crash
windows (failpoints): (a) ``episode.create.before_record`` — between ``create`` and recording the id nothing in
the database knows the instance: our server's idle sweep (``agentrl envs serve --instance_ttl_s``) closes it;
(b) ``episode.close.before_mark`` — between closing and marking it closed, a later attempt closes it again
(closing an id that is not open answers false, harmlessly).

Failures that say nothing about the policy are outcomes without a verdict (never trained; errors in evaluations):
``env_start_error`` (the server refused create/reset) and ``env_error`` (it refused a step). A server that cannot
be reached (:class:`~agentrl.envs.client.EnvUnavailable`) is infrastructure: the error propagates and the sampler
gives the slot back unscored, to be retried once the server is back (nothing is lost to an outage).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.actions import NO_ACTION_HINT, episode_messages, observation_message, parse_action
from agentrl.envs.base import EnvError, EnvSpec, StepResult
from agentrl.envs.client import EnvServerError
from agentrl.envs.protocol import ProtocolError, episode_reward, image_of, state_key_of
from agentrl.failpoints import failpoint
from agentrl.rollout.agent import (
    AgentResources,
    GenerationFailed,
    PlaceholderGenerated,
    TrajectoryResult,
    TurnState,
    generate_turn,
)
from agentrl.rollout.conversation import TokenConversation
from agentrl.rollout.tool_parsers import TrajectoryOutcome
from agentrl.store import CallStatus, SlotLease
from agentrl.store.call_log import CallLog
from agentrl.vision.images import LoadedImage

logger = logging.getLogger(__name__)


def episode_of(task_metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The ``env`` entry of a Task's metadata (``{name, data_idx}``), or ``None`` for other Tasks."""
    env = task_metadata.get("env")
    return env if isinstance(env, dict) else None


@dataclass
class Episode:
    """An episode's environment, task and the steps taken so far; its summary is derived from the steps."""

    spec: EnvSpec
    data_idx: int
    steps: list[StepResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """``{name, data_idx, reward, score, success, steps}`` for the Record's ``score_details``."""
        reward = episode_reward(self.steps)
        return {"name": self.spec.name, "data_idx": self.data_idx, "reward": reward,
                "score": reward * self.spec.reward_scale, "success": reward >= self.spec.success_reward,
                "steps": len(self.steps)}


async def run_episode(res: AgentResources, lease: SlotLease, calls: CallLog) -> TrajectoryResult:
    """Roll out ``lease``'s Task as an environment episode (see the module docstring), logging its calls."""
    if res.envs is None:
        raise EnvError("this sampler has no environments; Task metadata names one")
    env = episode_of(lease.task.metadata) or {}
    name = str(env.get("name"))
    episode, state = Episode(res.envs.spec(name), int(env.get("data_idx", 0))), TurnState()
    client = await res.envs.client(name)
    await _close_dead_attempts(res, lease)
    try:
        instance = await client.create()
    except EnvServerError as error:
        return _ended(TrajectoryOutcome.ENV_START_ERROR, 0, state, episode, f"environment create failed: {error}")
    try:
        failpoint("episode.create.before_record")
        try:
            await res.store.records.set_env_instance(lease.record_id, lease.lease_id,
                                                     {"name": name, "url": client.base_url, "id": instance})
            observation, state_key, picture = await client.reset_seen(instance, episode.data_idx)
        except EnvServerError as error:
            return _ended(TrajectoryOutcome.ENV_START_ERROR, 0, state, episode, f"environment reset failed: {error}")
        return await _play(res, lease, calls, client, instance, (observation, picture), state_key, state, episode)
    finally:
        await asyncio.shield(_close(res, lease.record_id, client, instance))


async def _play(res: AgentResources, lease: SlotLease, calls: CallLog, client: Any, instance: int,
                first: tuple[str, LoadedImage | None], state_key: str, state: TurnState,
                episode: Episode) -> TrajectoryResult:
    cfg, task, spec = res.config.rollout, lease.task, episode.spec
    env = episode_of(task.metadata) or {}
    action_format = env.get("action_format") or spec.action_format
    max_turns = min(int(env.get("max_turns") or cfg.max_turns), cfg.max_turns)
    pictures: dict[str, LoadedImage] = {}
    messages = episode_messages(task.system_prompt or spec.instruction, first[0])
    messages[-1] = await _seen(res, pictures, messages[-1], first[1])
    conversation = TokenConversation(res.tokenizer, messages, None, vision=res.vision, pictures=pictures)
    for turn in range(max_turns):
        try:
            generated = await generate_turn(res, lease, calls, conversation, turn, state)
        except GenerationFailed as error:
            return _ended(TrajectoryOutcome.FAILED_ERROR, turn, state, episode, str(error))
        except PlaceholderGenerated as error:
            return _ended(TrajectoryOutcome.VISION_TOKEN_ERROR, turn + 1, state, episode, str(error))
        action = parse_action(generated.text, action_format)
        if action is None:
            observation, done, picture = NO_ACTION_HINT[action_format], False, None
            calls.relabel(generated.call_id, CallStatus.FORMATERROR, error="no action in the reply",
                          env_step={"action": None, "observation": observation, "reward": 0.0, "done": False},
                          step_reward=0.0, done=False, state_key=state_key)
        else:
            await res.store.slots.fence(lease)  # a retired attempt steps no environment
            try:
                step = await client.step(instance, action)
            except EnvServerError as error:
                return _ended(TrajectoryOutcome.ENV_ERROR, turn + 1, state, episode,
                              f"environment step failed: {error}")
            episode.steps.append(step)
            observation, done = step.observation, step.done
            try:
                picture = image_of(step.info)
            except ProtocolError as error:
                return _ended(TrajectoryOutcome.ENV_ERROR, turn + 1, state, episode,
                              f"environment step failed: {error}")
            calls.annotate(generated.call_id, env_step={
                "action": action, "observation": observation, "reward": step.reward, "done": done,
                **({"score": step.info["score"]} if "score" in step.info else {})},
                step_reward=step.reward * spec.reward_scale, done=done, state_key=state_key)
            state_key = state_key_of(observation, step.info)
        if done:
            return _ended(TrajectoryOutcome.DONE, turn + 1, state, episode, None)
        message = await _seen(res, conversation.pictures, observation_message(observation), picture)
        state.appended(conversation.append(generated.output_ids, generated.text, [message]))
        if len(conversation.prompt_ids) + cfg.max_new_tokens > cfg.max_prompt_tokens:
            return _ended(TrajectoryOutcome.LENGTH_LIMIT_ERROR, turn + 1, state, episode, None)
    return _ended(TrajectoryOutcome.TURNS_LIMIT_ERROR, max_turns, state, episode, None)


async def _seen(res: AgentResources, pictures: dict[str, LoadedImage], message: dict[str, Any],
                picture: LoadedImage | None) -> dict[str, Any]:
    """``message`` (an observation) with its picture before its text, for a vision-language policy (the picture
    stored in GridFS and added to the conversation's ``pictures``); as it is otherwise."""
    if picture is None or res.vision is None:
        return message
    await res.store.images.put(picture)
    pictures[picture.sha256] = picture
    return {**message, "content": [{"type": "image", "image": picture.sha256},
                                   {"type": "text", "text": message["content"]}]}


def _ended(outcome: TrajectoryOutcome, turns: int, state: TurnState, episode: Episode,
           error: str | None) -> TrajectoryResult:
    return TrajectoryResult(outcome, None, turns, state.branches, state.first_version, error=error,
                            env=episode.summary())


async def _close(res: AgentResources, record_id: str, client: Any, instance: int) -> None:
    """Close an instance and mark it closed; failures are logged (a later attempt or the idle sweep closes it)."""
    try:
        await client.close(instance)
        failpoint("episode.close.before_mark")
        await res.store.records.mark_env_closed(record_id)
    except Exception as error:  # noqa: BLE001 - closing is best effort here; the Record says it is still open
        logger.warning("could not close environment instance %s of %s: %s", instance, record_id, error)


async def _close_dead_attempts(res: AgentResources, lease: SlotLease) -> None:
    """Close the instances of this slot's earlier attempts that never closed theirs (their sampler died)."""
    if lease.attempt == 1:  # attempts count from 1: the first has no predecessor
        return
    for record in await res.store.records.open_env_instances(lease.task.id, lease.slot, lease.attempt):
        instance = record.env_instance or {}
        try:
            await res.envs.close_instance(str(instance["name"]), str(instance["url"]), int(instance["id"]))
        except Exception as error:  # noqa: BLE001 - a server that is gone took its instances with it
            logger.info("instance %s of dead attempt %s not closed (%s)", instance.get("id"), record.id, error)
        await res.store.records.mark_env_closed(record.id)
