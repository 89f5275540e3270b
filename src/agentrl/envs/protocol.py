"""AgentGym's environment-server HTTP protocol, per environment, as data: what our server sends and our client reads.

Both :mod:`agentrl.envs.server` and :mod:`agentrl.envs.client` take every field name and payload shape from
here, so they cannot drift apart. The routes are AgentGym's: ``GET /`` (banner), ``POST /create``,
``POST /reset``, ``POST /step {id, action}``, ``GET /observation?id=``, ``GET /detail?id=``, ``POST /close {id}``.
Errors are HTTP 200 with ``{"error": "..."}``; a request missing a field is FastAPI's HTTP 422.

- textcraft: id field ``id``; reset ``{id, data_idx=0}``. ``create`` → ``{id, observation, done, reward}`` and
  loads task ``data_idx = id``; ``reset`` → ``{id, observation, done, reward}``; ``GET /observation`` → the string.
- babyai: id field ``id``; reset ``{id, data_idx}``. ``create`` → ``{id}``; ``reset`` → ``{observation, reward,
  score, deleted, done}``; ``GET /observation`` → ``{observation, reward, score, done, deleted}``.
- sciworld: id field ``id``; reset ``{id, data_idx}``. ``create`` → ``{id}``; ``reset`` → ``{task_name, var_num,
  task_description, observation, reward, score, deleted, done}``; ``GET /observation`` → the string.
- any other name we serve: reset ``{id, data_idx}``. ``create`` → ``{id}``; ``reset`` → ``{id, observation, reward,
  score, done}``; ``GET /observation`` → the string.

``step`` returns ``{observation, reward, done}`` (textcraft) or ``{observation, reward, score, done}`` (the others;
``score`` is cumulative: the environment's own where it reports one in ``StepResult.info["score"]``, else the sum
of step rewards). ``close`` returns ``true``, or ``false`` for an id that is not open. Error texts are AgentGym's:
``The id 7 is not valid.``, ``The task with environment 7 has been deleted.`` (SciWorld keeps closed ids),
``The task with environment 7 has finished.`` (BabyAI and SciWorld refuse step, observation and detail once done;
our TextCraft refuses step, where AgentGym's keeps accepting actions). SciWorld's first observation is
``task_description + "\\n" + observation`` (AgentGym's client joins them), so our server sends the environment's
first observation with that prefix removed: a SciWorld environment's first observation must start with it.

Our server adds ``state_key`` to every response that carries an observation, where the environment has one
(``Environment.state_key``: the state the next action acts in, for per-turn credit); AgentGym's clients ignore the
field, and for a server without it :func:`state_key_of` keys the state by a hash of the observation text.

Other AgentGym servers are reached with the client only (``served=False``): their id and task fields come from the
same table (``env_idx`` for WebShop, SQLGym and SearchQA; ALFWorld's reset takes ``game`` and ``world_type``) and
their responses are read leniently (an observation under ``observation`` or ``state``, or a bare string, or the
first item of a list; ``reward`` 0 and ``done`` false when absent).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentrl.envs.base import StepResult
from agentrl.vision.images import ImageError, LoadedImage, decode_image_string

ERROR_NOT_VALID = "The id {id} is not valid."
ERROR_DELETED = "The task with environment {id} has been deleted."
ERROR_FINISHED = "The task with environment {id} has finished."
ERROR_NOT_RESET = "The task with environment {id} has not been reset: call /reset with a data_idx first."
"""Ours: AgentGym has no message for a step before the first reset (its servers fail with an internal error)."""

ROUTES_REFUSED_WHEN_DONE = ("step", "observation", "detail")

STATE_KEY_FIELD = "state_key"
"""Ours: the environment's key of the state an observation shows (an extra field of reset and step responses)."""
IMAGE_FIELD = "image"
"""An extra field of reset and step responses: a picture of the observation, base64 (or a data: URI), from servers
that draw one (ours with ``--images``)."""


@dataclass(frozen=True)
class WireFormat:
    """One environment's dialect of the protocol (see the module docstring for the table)."""

    banner: str
    """What ``GET /`` returns (AgentGym's scripts use it as the health check)."""
    id_field: str = "id"
    task_field: str = "data_idx"
    """The field of ``/reset`` naming the task."""
    task_required: bool = True
    """False where AgentGym defaults the task to 0 (TextCraft)."""
    reset_extra: dict[str, Any] = field(default_factory=dict)
    """Further fields the client sends to ``/reset`` (ALFWorld's ``world_type``)."""
    create_task_field: str | None = None
    """Where ``/create`` itself takes the task (SearchQA)."""
    served: bool = True
    """Our server speaks this dialect; False: known to the client only."""
    create_loads_task: bool = False
    """``/create`` resets the new instance to task ``id`` (TextCraft's behaviour, kept for compatibility)."""
    create_fields: tuple[str, ...] = ("id",)
    reset_fields: tuple[str, ...] = ("id", "observation", "reward", "score", "done")
    step_fields: tuple[str, ...] = ("observation", "reward", "score", "done")
    observation_fields: tuple[str, ...] | None = None
    """``GET /observation`` returns these fields as an object; None: the observation string itself."""
    first_observation_prefix: str | None = None
    """A reset field that, followed by a newline, precedes ``observation`` in the episode's first observation."""
    refused_when_done: tuple[str, ...] = ("step",)
    closed_error: str = ERROR_NOT_VALID
    """The error for an id that was open once and is closed now."""


FORMATS: dict[str, WireFormat] = {
    "textcraft": WireFormat(
        banner="This is environment TextCraft.", task_required=False, create_loads_task=True,
        create_fields=("id", "observation", "done", "reward"), reset_fields=("id", "observation", "done", "reward"),
        step_fields=("observation", "reward", "done")),
    "babyai": WireFormat(
        banner="This is environment BabyAI.", reset_fields=("observation", "reward", "score", "deleted", "done"),
        observation_fields=("observation", "reward", "score", "done", "deleted"),
        refused_when_done=ROUTES_REFUSED_WHEN_DONE),
    "sciworld": WireFormat(
        banner="This is environment ScienceWorld.",
        reset_fields=("task_name", "var_num", "task_description", "observation", "reward", "score", "deleted",
                      "done"),
        first_observation_prefix="task_description", refused_when_done=ROUTES_REFUSED_WHEN_DONE,
        closed_error=ERROR_DELETED),
    "alfworld": WireFormat(banner="This is environment AlfWorld.", task_field="game",
                           reset_extra={"world_type": "Text"}, served=False),
    "webshop": WireFormat(banner="ok", id_field="env_idx", task_field="session_id", served=False),
    "sqlgym": WireFormat(banner="ok", id_field="env_idx", task_field="item_id", served=False),
    "searchqa": WireFormat(banner="ok", id_field="env_idx", task_field="id", create_task_field="id", served=False),
}


class ProtocolError(ValueError):
    """A payload could not be built or read in the environment's dialect; the message says which field."""


def wire_format(name: str) -> WireFormat:
    """The dialect of environment ``name`` (case-insensitive); the generic one for names not in :data:`FORMATS`."""
    return FORMATS.get(name.lower()) or WireFormat(banner=f"This is environment {name}.")


# --- building payloads (server) ---------------------------------------------------------------------------------

def payload(fields: tuple[str, ...], state: Mapping[str, Any], *, what: str) -> dict[str, Any]:
    """The response ``what`` made of ``fields`` taken from an instance's ``state``."""
    missing = [name for name in fields if name not in state]
    if missing:
        raise ProtocolError(f"the {what} response needs {', '.join(map(repr, missing))}, which the environment "
                            "does not provide (its detail() should)")
    return {name: state[name] for name in fields}


def wire_first_observation(fmt: WireFormat, observation: str, state: Mapping[str, Any]) -> str:
    """The ``observation`` field of ``/reset`` for an episode whose first observation is ``observation``."""
    if fmt.first_observation_prefix is None:
        return observation
    head = f"{state.get(fmt.first_observation_prefix, '')}\n"
    return observation[len(head):] if observation.startswith(head) else observation


# --- building requests and reading responses (client) -----------------------------------------------------------

def create_body(fmt: WireFormat, data_idx: int | None) -> dict[str, Any]:
    return {fmt.create_task_field: data_idx} if fmt.create_task_field and data_idx is not None else {}


def reset_body(fmt: WireFormat, instance: int, data_idx: int) -> dict[str, Any]:
    return {fmt.id_field: instance, fmt.task_field: data_idx, **fmt.reset_extra}


def step_body(fmt: WireFormat, instance: int, action: str) -> dict[str, Any]:
    return {fmt.id_field: instance, "action": action}


def instance_body(fmt: WireFormat, instance: int) -> dict[str, Any]:
    """The body of ``/close`` and the query of ``/observation`` and ``/detail``."""
    return {fmt.id_field: instance}


def error_of(response: Any) -> str | None:
    """The message of an AgentGym error body ``{"error": ...}``, else None."""
    if isinstance(response, dict) and "error" in response:
        return str(response["error"])
    return None


def read_id(fmt: WireFormat, response: Any) -> int:
    """The instance id in a ``/create`` response (an object with the id field, or a bare integer)."""
    if isinstance(response, int) and not isinstance(response, bool):
        return response
    if isinstance(response, dict):
        for key in (fmt.id_field, "id", "env_idx"):
            value = response.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    raise ProtocolError(f"expected the new instance's id ({fmt.id_field!r}) in the create response, got "
                        f"{_brief(response)}")


def read_observation(response: Any) -> str:
    """The observation in a response: a string, an object's ``observation`` or ``state``, or a list's first item."""
    if isinstance(response, str):
        return response
    if isinstance(response, list) and response and isinstance(response[0], str):
        return response[0]
    if isinstance(response, dict):
        for key in ("observation", "state"):
            if isinstance(response.get(key), str):
                return response[key]
    raise ProtocolError(f"expected an observation in the response, got {_brief(response)}")


def first_observation(fmt: WireFormat, response: Any) -> str:
    """The episode's first observation from a ``/reset`` response (SciWorld: task description, newline, look)."""
    observation = read_observation(response)
    prefix = fmt.first_observation_prefix
    if prefix and isinstance(response, dict) and response.get(prefix) is not None:
        return f"{response[prefix]}\n{observation}"
    return observation


def read_step(response: Any) -> StepResult:
    """A ``/step`` response as a :class:`StepResult`; fields besides observation, reward and done go to ``info``
    (``info["score"]`` is the server's cumulative score where it reports one)."""
    if not isinstance(response, dict):
        raise ProtocolError(f"expected an object from /step, got {_brief(response)}")
    observation = read_observation(response)
    try:
        reward = float(response.get("reward") or 0.0)
    except (TypeError, ValueError):
        raise ProtocolError(f"expected a number as the step's reward, got {response.get('reward')!r}") from None
    info = {key: value for key, value in response.items()
            if key not in ("observation", "state", "reward", "done") and value is not None}
    return StepResult(observation=observation, reward=reward, done=bool(response.get("done", False)), info=info)


def image_of(response: Any) -> LoadedImage | None:
    """The picture a reset or step response (or a step's ``info``) carries in :data:`IMAGE_FIELD`, checked; None
    without one. :class:`ProtocolError` for one that is not a usable image."""
    value = response.get(IMAGE_FIELD) if isinstance(response, Mapping) else None
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"expected a base64 picture in {IMAGE_FIELD!r}, got {type(value).__name__}")
    try:
        return decode_image_string(value, f"the observation's {IMAGE_FIELD!r}")
    except ImageError as error:
        raise ProtocolError(str(error)) from None


def state_key_of(observation: str, response: Any) -> str:
    """The key of the state a response shows: the server's ``state_key``, else a hash of the observation text."""
    key = response.get(STATE_KEY_FIELD) if isinstance(response, dict) else None
    if isinstance(key, str) and key:
        return key
    return "observation:" + hashlib.sha256(observation.encode()).hexdigest()[:24]


def episode_reward(steps: Iterable[StepResult]) -> float:
    """An episode's total reward: the latest cumulative ``info["score"]`` where the server reports one (BabyAI,
    SciWorld), else the sum of the step rewards."""
    total, score = 0.0, None
    for step in steps:
        total += step.reward
        if "score" in step.info:
            score = float(step.info["score"])
    return total if score is None else score


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
