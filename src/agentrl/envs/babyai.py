"""BabyAI: AgentGym's text layer over minigrid's BabyAI levels, solved by minigrid's ``BabyAIBot`` as oracle.

Tasks. ``data_idx`` picks one of AgentGym's 40 levels and a seed: level ``LEVELS[data_idx % 40]``, seed
``data_idx // 40`` (AgentGym: ``all_levels[data_idx % 40 + 1]``, ``seed=data_idx // 40``), so a task is
deterministic. AgentGym publishes 810 training and 90 test items; the splits here are the contiguous ranges
``train = range(0, 810)`` and ``test = range(810, 900)`` (AgentGym's evaluation file names its own 90 ids, which
are not shipped here). minigrid 3.2 no longer registers ``BabyAI-GoToObjS6-v0``; its ``-v1`` (the same level,
room size 6) stands in. Layouts for a seed may differ from those of the minigrid < 2.5 AgentGym used.

Observations (AgentGym's content, in our own words). The agent sees its 7x7 egocentric view: every visible door,
key, ball and box, labelled with a per-name counter in order of distance (``red ball 1``, ``grey locked door 2``;
doors carry their state), with its position in steps ahead and to the left or right; the nearest wall or box
straight ahead; what it carries. The first observation starts with ``Your goal: <mission>`` (minigrid's mission,
unaltered: AgentGym rewrote "then"/"after you" to "and", which hides the order a mission asks for); every
observation but the last ends with ``Available actions: [...]`` (a JSON list).

Actions (AgentGym's vocabulary). ``turn left``, ``turn right``, ``move forward``, ``pickup <obj> <n>`` (walk to
face it, pick it up; ``pick up`` is accepted too), ``drop``, ``go through <open door> <n>`` (walk into the
doorway), ``toggle and go through <closed or locked door> <n>`` (walk to it, open it - a locked door needs the
carried key of its colour - and step into the doorway), ``toggle`` (the door or box right ahead), ``go to <obj>
<n>`` (walk to face it) and ``check available actions``. Case and punctuation are ignored. A high-level action
runs as minigrid primitives along a shortest path through visible cells the agent can stand on; the run stops
early when a primitive has no effect, the mission is completed or the step budget runs out. An action that is
not available is not an error: its observation says why and lists what is (as in AgentGym). Differences from
AgentGym, so that a listed action does what it says and every level can be solved: paths avoid closed doors and
cells out of sight (AgentGym's could cross both, and a row behind the agent); ``move forward`` and ``drop`` are
listed only when minigrid would carry them out; an object's number in an action is the one the observation gives
it (AgentGym renumbered unreachable objects away); ``toggle`` also closes an open door (a mission to open a door
that is already open needs it) and opens a box (``KeyInBox`` hides its key in one; AgentGym could not open it);
``go to`` an object already faced runs minigrid's no-op ``done``, so that the mission check sees the agent there
(AgentGym ran nothing, so such a "go to" mission could not be completed by it).

Reward, end and success. A step's reward is minigrid's for its primitives: ``1 - 0.9 * steps / max_steps`` on the
primitive that completes the mission, else 0; ``info["score"]`` is the episode's sum. AgentGym ends an episode
(``done``) only when the completing reward exceeds 0.5, i.e. the mission was completed within 5/9 of the level's
primitive budget ``max_steps`` (its guard against "skipping" steps); anything else minigrid reports - a later
completion, a failure (only the strict-order ``...Debug`` levels report failures, and minigrid 3.2 misreports one
after the first door of every two-door ``OpenDoorsOrder`` mission), running out of the budget - leaves its
episode running on. Here the episode ends on any completion (the reward, however small, stays in the score) and
when the budget runs out (reward 0); a failure report is ignored as in AgentGym (the mission can still be
completed, so those ``OpenDoorsOrder`` missions stay solvable). ``success_reward = 0.5`` keeps AgentGym's rule for
success: the mission completed within 5/9 of the budget. (AgentGym's own success metric, total reward == 1, is
never met in BabyAI; its published BabyAI figure is the mean score.)

Oracle. ``oracle(data_idx)`` runs ``BabyAIBot`` through this environment, one text action per bot primitive
(``turn left``/``turn right``/``move forward``/``drop``/``toggle``; its pickup as ``pickup <obj in front> <n>``,
its ``done`` as ``go to <obj in front> <n>``), then shortens the plan: where a listed ``go to``/``pickup``/``go
through``/``toggle and go through`` ends in the pose the bot walks to (turns and moves in which the mission made
no progress), followed by the same pickup or door opening, it stands for that stretch. The shortened plan is kept
if its replay succeeds, else the primitive plan (itself a successful replay). Two bot gaps are bridged: boxes that
hide something are opened first (the bot walks there), and in ``PutNext...Carrying`` the bot's "fetch the object"
subgoals are dropped since the agent starts with it in hand. A task the bot still cannot solve - it gives up,
cycles without acting, or completes the mission too late to count as a success - raises ``EnvError``.

Nothing is displayed: minigrid imports pygame but no window is opened (with ``--images`` the agent's view is drawn
into an array, :meth:`BabyAIEnv.image`), and minigrid's prints while it lays out a level go to stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import minigrid  # noqa: F401  (registers the BabyAI-* levels with gymnasium)
from minigrid.core.actions import Actions
from minigrid.core.grid import Grid
from minigrid.core.world_object import WorldObj
from minigrid.envs.babyai.core.verifier import PutNextInstr, SeqInstr
from minigrid.utils.baby_ai_bot import BabyAIBot, GoNextToSubgoal, PickupSubgoal
from PIL import Image

from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult

IMAGE_TILE = 8
"""Pixels per grid cell of the agent's view when it is drawn (``--images``): 7 cells, a 56 x 56 picture."""

LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v1", "BabyAI-GoToLocalS8N7-v0", "BabyAI-GoToObjMazeS7-v0", "BabyAI-GoToImpUnlock-v0",
    "BabyAI-GoToSeqS5R2-v0", "BabyAI-GoToRedBlueBall-v0", "BabyAI-GoToDoor-v0", "BabyAI-GoToObjDoor-v0",
    "BabyAI-Open-v0", "BabyAI-OpenRedDoor-v0", "BabyAI-OpenDoorLoc-v0", "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0", "BabyAI-Pickup-v0", "BabyAI-UnblockPickup-v0", "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0", "BabyAI-PickupAbove-v0", "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0", "BabyAI-Unlock-v0", "BabyAI-UnlockLocalDist-v0", "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0", "BabyAI-BlockedUnlockPickup-v0", "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0", "BabyAI-FindObjS7-v0", "BabyAI-KeyCorridorS6R3-v0", "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0", "BabyAI-SynthS5R2-v0", "BabyAI-SynthLoc-v0", "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0", "BabyAI-BossLevel-v0", "BabyAI-BossLevelNoUnlock-v0",
)
"""AgentGym's levels 1..40, in its order (``data_idx % 40`` indexes this tuple)."""

SPLITS: dict[str, range] = {"train": range(0, 810), "test": range(810, 900)}
NUM_TASKS = SPLITS["test"].stop
SUCCESS_REWARD = 0.5
MAX_TURNS = 20
"""AgentGym's evaluation budget for BabyAI (``max_round`` 20)."""

INSTRUCTION = (
    "You are an agent in a grid world of rooms (BabyAI) and must accomplish the goal you are given. Each turn "
    "you receive an observation: the goal (first turn), what you can see from where you stand - objects are "
    "numbered, e.g. 'red ball 1', and placed in steps ahead of you and to your left or right - what you carry, "
    "and the list of actions available right now. Take exactly one action per turn, copied from the list of "
    "available actions: turn left or right, move forward, go to an object, pick up an object, drop what you "
    "carry, go through an open door, toggle a closed door open and go through it (a locked door needs the key "
    "of its colour), toggle the door or box right in front of you (a box opens and shows what it holds), or "
    "check the available actions. You only see the cells in front of you, so turn and move to explore.\n"
    "Reply in this format:\nThought: <your reasoning>\nAction: <one action from the list>"
)

CHECK_ACTIONS = "check available actions"
_MOVES = (Actions.forward, Actions.left, Actions.right)
_NOT_ACTION_TEXT = re.compile(r"[^a-z0-9 ]")


def task_of(data_idx: int) -> tuple[str, int]:
    """(level id, seed) of task ``data_idx`` (AgentGym's mapping)."""
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _name(obj: WorldObj) -> str:
    """An object's name in text (AgentGym's): ``red ball``, ``blue locked door``."""
    if obj.type == "door":
        state = "open" if obj.is_open else "locked" if obj.is_locked else "closed"
        return f"{obj.color} {state} door"
    return f"{obj.color} {obj.type}"


@dataclass(frozen=True)
class _Seen:
    """A visible door, key, ball or box, in the agent's frame (``ahead`` >= 0; ``right`` < 0 is to the left)."""

    label: str
    obj: WorldObj
    cell: tuple[int, int]
    ahead: int
    right: int

    def where(self) -> str:
        side = f"{_plural(abs(self.right), 'step')} to your {'right' if self.right > 0 else 'left'}"
        if self.right == 0:
            return f"{_plural(self.ahead, 'step')} straight ahead"
        if self.ahead == 0:
            return side
        return f"{_plural(self.ahead, 'step')} ahead, {side}"


@dataclass
class _View:
    """What the agent perceives now: the description, the available actions (text -> minigrid primitives) and
    why some recognisable actions are not available (text -> message)."""

    description: str
    actions: dict[str, list[int]] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)


class _Paths:
    """Breadth-first search over (cell, direction) in the agent's egocentric view: shortest primitive sequences
    (forward tried before turns) through visible cells the agent can stand on."""

    def __init__(self, grid: Grid, visible: Any, start: tuple[int, int]) -> None:
        self._parent: dict[tuple[tuple[int, int], tuple[int, int]], tuple[Any, int] | None] = {}
        self.order: list[tuple[tuple[int, int], tuple[int, int]]] = []
        first = (start, (0, -1))  # the agent stands at the bottom centre, facing up (-j)
        self._parent[first] = None
        queue = deque([first])
        while queue:
            state = queue.popleft()
            self.order.append(state)
            (i, j), (di, dj) = state
            for action, successor in (
                (Actions.forward, ((i + di, j + dj), (di, dj))),
                (Actions.left, ((i, j), (dj, -di))),
                (Actions.right, ((i, j), (-dj, di))),
            ):
                if successor in self._parent:
                    continue
                if action == Actions.forward and not self.standable(grid, visible, successor[0]):
                    continue
                self._parent[successor] = (state, action)
                queue.append(successor)

    @staticmethod
    def standable(grid: Grid, visible: Any, cell: tuple[int, int]) -> bool:
        """Whether the agent can step onto ``cell``: in view, visible, empty or an open door."""
        i, j = cell
        if not (0 <= i < grid.width and 0 <= j < grid.height and visible[i, j]):
            return False
        obj = grid.get(i, j)
        return obj is None or (obj.can_overlap() and obj.type != "lava")

    def _path(self, state: tuple[tuple[int, int], tuple[int, int]]) -> list[int]:
        path: list[int] = []
        link = self._parent[state]
        while link is not None:
            state, action = link
            path.append(int(action))
            link = self._parent[state]
        return path[::-1]

    def facing(self, cell: tuple[int, int]) -> list[int] | None:
        """The shortest way to stand next to ``cell`` facing it, or ``None``."""
        for state in self.order:
            (i, j), (di, dj) = state
            if (i + di, j + dj) == cell:
                return self._path(state)
        return None

    def onto(self, cell: tuple[int, int]) -> list[int] | None:
        """The shortest way to stand on ``cell``, or ``None``."""
        for state in self.order:
            if state[0] == cell:
                return self._path(state)
        return None


@dataclass(frozen=True)
class _Scene:
    """The agent's view at one moment, in its egocentric grid (the agent at ``me``, facing up): the visible doors,
    keys, balls and boxes, numbered as the observation gives them, the nearest wall or box straight ahead (text,
    steps), what the agent carries, and the paths it can walk."""

    grid: Grid
    visible: Any
    me: tuple[int, int]
    carrying: WorldObj | None
    objects: list[_Seen]
    barrier: tuple[str, int] | None
    paths: _Paths

    @property
    def ahead_cell(self) -> tuple[int, int]:
        return self.me[0], self.me[1] - 1

    @property
    def in_front(self) -> WorldObj | None:
        return self.grid.get(*self.ahead_cell)


def _scene(game: Any) -> _Scene:
    """What the agent of ``game`` sees now: objects labelled by a per-name counter in order of distance."""
    grid, visible = game.gen_obs_grid()
    size = game.agent_view_size
    me = (size // 2, size - 1)
    seen: list[tuple[int, int, int, WorldObj, tuple[int, int]]] = []
    barrier: tuple[str, int] | None = None
    for j in range(size):
        for i in range(size):
            obj = grid.get(i, j)
            if (i, j) == me or obj is None or not visible[i, j]:
                continue
            ahead, right = me[1] - j, i - me[0]
            if right == 0 and obj.type in ("wall", "box") and (barrier is None or ahead < barrier[1]):
                barrier = (obj.type if obj.type == "wall" else _name(obj), ahead)
            if obj.type in ("door", "key", "ball", "box"):
                seen.append((ahead + abs(right), -ahead, right, obj, (i, j)))
    seen.sort(key=lambda item: item[:3])
    counts: dict[str, int] = {}
    objects: list[_Seen] = []
    for _, minus_ahead, right, obj, cell in seen:
        name = _name(obj)
        counts[name] = counts.get(name, 0) + 1
        objects.append(_Seen(f"{name} {counts[name]}", obj, cell, -minus_ahead, right))
    return _Scene(grid, visible, me, game.carrying, objects, barrier, _Paths(grid, visible, me))


def _describe(scene: _Scene) -> str:
    """The observation's text: the objects and where they are, the barrier ahead, what the agent carries."""
    objects, barrier, carrying = scene.objects, scene.barrier, scene.carrying
    parts = [("You see: " + ", ".join(f"{o.label} ({o.where()})" for o in objects) + ".") if objects
             else "You see no objects."]
    if barrier is not None:
        parts.append(f"Straight ahead there is a {barrier[0]} {_plural(barrier[1], 'step')} away.")
    parts.append(f"You are carrying a {_name(carrying)}." if carrying else "You are not carrying anything.")
    return " ".join(parts)


def _add_moves(view: _View, scene: _Scene) -> None:
    """``turn left``, ``turn right`` and, when the cell ahead can be stood on, ``move forward``."""
    view.actions["turn left"] = [int(Actions.left)]
    view.actions["turn right"] = [int(Actions.right)]
    if _Paths.standable(scene.grid, scene.visible, scene.ahead_cell):
        view.actions["move forward"] = [int(Actions.forward)]
    else:
        blocker = _name(scene.in_front) if scene.in_front is not None else "wall"
        view.refusals["move forward"] = f"You cannot move forward: a {blocker} is in the way."


def _add_pickups(view: _View, scene: _Scene) -> None:
    """``pickup <obj> <n>`` for every key, ball and box the empty-handed agent can walk up to."""
    carrying = scene.carrying
    for o in scene.objects:
        if o.obj.type == "door":
            continue
        action = f"pickup {o.label}"
        path = scene.paths.facing(o.cell)
        if carrying:
            view.refusals[action] = f"You cannot pick up {o.label}: you are already carrying a {_name(carrying)}."
        elif path is None:
            view.refusals[action] = f"You cannot pick up {o.label}: there is no path to it."
        else:
            view.actions[action] = path + [int(Actions.pickup)]


def _add_drop(view: _View, scene: _Scene) -> None:
    """``drop`` when the agent carries something and the cell in front is empty."""
    carrying, in_front = scene.carrying, scene.in_front
    if carrying is None:
        view.refusals["drop"] = "You cannot drop anything: you are not carrying anything."
    elif in_front is not None:
        view.refusals["drop"] = f"You cannot drop the {_name(carrying)}: the cell in front of you is not empty."
    else:
        view.actions["drop"] = [int(Actions.drop)]


def _add_door(view: _View, scene: _Scene, door: _Seen) -> None:
    """``go through`` an open door, ``toggle and go through`` a closed one (a locked one needs the key carried)."""
    through, open_through = f"go through {door.label}", f"toggle and go through {door.label}"
    if door.obj.is_open:
        path = scene.paths.onto(door.cell)
        view.refusals[open_through] = f"{door.label} is already open: go through it."
        if path is None:
            view.refusals[through] = f"You cannot go through {door.label}: there is no path to it."
        else:
            view.actions[through] = path
        return
    view.refusals[through] = (f"You cannot go through {door.label}: it is "
                              f"{'locked' if door.obj.is_locked else 'closed'}; open it first.")
    refusal = _toggle_refusal(door.obj, scene.carrying)
    path = scene.paths.facing(door.cell)
    if refusal is not None:
        view.refusals[open_through] = f"You cannot open {door.label}: {refusal}."
    elif path is None:
        view.refusals[open_through] = f"You cannot go to {door.label}: there is no path to it."
    else:
        view.actions[open_through] = path + [int(Actions.toggle), int(Actions.forward)]


def _add_toggle(view: _View, scene: _Scene) -> None:
    """``toggle`` the door or box right ahead."""
    in_front = scene.in_front
    if in_front is None or in_front.type not in ("door", "box"):
        view.refusals["toggle"] = "There is no door or box in front of you to toggle."
    elif (refusal := _toggle_refusal(in_front, scene.carrying)) is not None:
        view.refusals["toggle"] = f"You cannot toggle the {_name(in_front)}: {refusal}."
    else:
        view.actions["toggle"] = [int(Actions.toggle)]


def _add_go_tos(view: _View, scene: _Scene) -> None:
    """``go to <obj> <n>`` for every object the agent can walk up to."""
    for o in scene.objects:
        action = f"go to {o.label}"
        path = scene.paths.facing(o.cell)
        if path is None:
            view.refusals[action] = f"You cannot go to {o.label}: there is no path to it."
        else:  # already facing it: minigrid's no-op "done" lets the mission check see the agent there
            view.actions[action] = path or [int(Actions.done)]


def _perceive(game: Any) -> _View:
    """Describe the agent's view and list the actions available in it (AgentGym's text layer, in its order)."""
    scene = _scene(game)
    view = _View(_describe(scene))
    _add_moves(view, scene)
    _add_pickups(view, scene)
    _add_drop(view, scene)
    for door in scene.objects:
        if door.obj.type == "door":
            _add_door(view, scene, door)
    _add_toggle(view, scene)
    _add_go_tos(view, scene)
    view.actions[CHECK_ACTIONS] = []
    return view


def _toggle_refusal(obj: WorldObj, carrying: WorldObj | None) -> str | None:
    """Why toggling ``obj`` (a door or box) would do nothing, or ``None``: only a locked door refuses, without the
    key of its colour."""
    if obj.type != "door" or not obj.is_locked:
        return None
    if carrying is None or carrying.type != "key":
        return f"it is locked and needs a {obj.color} key"
    if carrying.color != obj.color:
        return f"it needs a {obj.color} key and you carry a {carrying.color} key"
    return None


def _normalise(action: str) -> str:
    """Lower case, only letters, digits and single spaces (AgentGym's client cleaning); ``pick up`` -> ``pickup``."""
    text = " ".join(_NOT_ACTION_TEXT.sub(" ", action.lower()).split())
    return "pickup" + text[len("pick up"):] if text.startswith("pick up ") else text


class BabyAIEnv(Environment):
    """One BabyAI episode at a time, through AgentGym's text layer (see the module docstring)."""

    def __init__(self) -> None:
        self._games: dict[str, Any] = {}
        self._game: Any = None
        self._level = ""
        self._seed = -1
        self._data_idx = -1
        self._view = _View("")
        self._observation = ""
        self._score = 0.0
        self._done = False

    @property
    def game(self) -> Any:
        """The running minigrid level (``gymnasium`` env); ``EnvError`` before ``reset``."""
        if self._game is None:
            raise EnvError("no BabyAI task is loaded: call reset(data_idx) first")
        return self._game

    @property
    def done(self) -> bool:
        return self._done

    @property
    def score(self) -> float:
        """The episode's total reward so far."""
        return self._score

    @property
    def available_actions(self) -> dict[str, list[int]]:
        """The available actions now, each with the minigrid primitives it runs."""
        return dict(self._view.actions)

    def reset(self, data_idx: int) -> str:
        if isinstance(data_idx, bool) or not isinstance(data_idx, int) or not 0 <= data_idx < NUM_TASKS:
            raise EnvError(f"BabyAI task index must be an integer in [0, {NUM_TASKS}), got {data_idx!r}")
        self._level, self._seed = task_of(data_idx)
        if self._level not in self._games:
            self._games[self._level] = gymnasium.make(self._level)
        self._game = self._games[self._level]
        with contextlib.redirect_stdout(sys.stderr):  # minigrid prints its layout re-draws ("Sampling rejected")
            self._game.reset(seed=self._seed)
        self._data_idx, self._score, self._done = data_idx, 0.0, False
        self._view = _perceive(self._game.unwrapped)
        self._observation = f"Your goal: {self._game.unwrapped.mission}\n{self._view.description}{self._listing()}"
        return self._observation

    def state_key(self) -> str | None:
        """The level's task, the grid (doors opened, objects moved), the agent's pose and what it carries."""
        if self._game is None:
            return None
        world = self._game.unwrapped
        grid = hashlib.sha256(world.grid.encode().tobytes()).hexdigest()[:16]
        carrying = f"{world.carrying.color} {world.carrying.type}" if world.carrying else "nothing"
        pose = f"{tuple(int(v) for v in world.agent_pos)}|{world.agent_dir}"
        return f"{self._level}:{self._seed}|{grid}|{pose}|{carrying}"

    def image(self) -> bytes | None:
        """The agent's 7x7 view as minigrid draws it (``get_pov_render``, tiles of :data:`IMAGE_TILE` pixels: a
        56 x 56 PNG): the picture of what the observation describes."""
        if self._game is None:
            return None
        out = io.BytesIO()
        Image.fromarray(self._game.unwrapped.get_pov_render(tile_size=IMAGE_TILE)).save(out, "PNG")
        return out.getvalue()

    def step(self, action: str) -> StepResult:
        game = self.game
        if self._done:
            raise EnvError(f"BabyAI task {self._data_idx} has finished: reset it to play again")
        command = _normalise(action)
        primitives = self._view.actions.get(command)
        if command.startswith("check"):
            return self._result(f"You can take these actions: {', '.join(self._view.actions)}.", 0.0)
        if primitives is None:
            reason = self._view.refusals.get(command) or (
                f"'{command}' is not an available action now." if command else "No action was given.")
            return self._result(f"{reason} Choose one of the available actions.", 0.0)

        unwrapped = game.unwrapped
        reward, truncated = 0.0, False
        for primitive in primitives:  # minigrid's failure termination is not an end (see the module docstring)
            before = self._effect_state(unwrapped)
            _, step_reward, _, truncated, _ = game.step(primitive)
            reward += float(step_reward)
            if reward > 0 or truncated or self._effect_state(unwrapped) == before:
                break
        self._view = _perceive(unwrapped)
        self._done = reward > 0 or truncated
        text = self._view.description
        if reward > 0:
            text += " The task is completed."
        elif truncated:
            text += " You have run out of steps: the task has failed."
        return self._result(text, reward)

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        for game in self._games.values():
            game.close()
        self._games.clear()
        self._game = None

    def detail(self) -> dict[str, Any]:
        if self._game is None:
            return {}
        return {"data_idx": self._data_idx, "level": self._level, "seed": self._seed,
                "goal": self._game.unwrapped.mission, "score": self._score, "done": self._done}

    @staticmethod
    def _effect_state(game: Any) -> tuple[Any, ...]:
        """What a primitive can change: position, direction, what is carried, the cell ahead."""
        ahead = game.grid.get(*game.front_pos)
        return (tuple(game.agent_pos), game.agent_dir, id(game.carrying), ahead.encode() if ahead else None)

    def _listing(self) -> str:
        return "" if self._done else f"\nAvailable actions: {json.dumps(list(self._view.actions))}"

    def _result(self, text: str, reward: float) -> StepResult:
        self._score += reward
        self._observation = text + self._listing()
        return StepResult(observation=self._observation, reward=reward, done=self._done,
                          info={"score": self._score})


# --- oracle ------------------------------------------------------------------------------------------------

_SINGLE_PRIMITIVE_ACTIONS = {int(Actions.left): "turn left", int(Actions.right): "turn right",
                             int(Actions.forward): "move forward", int(Actions.drop): "drop",
                             int(Actions.toggle): "toggle"}


def _text_for(env: BabyAIEnv, primitive: int) -> str:
    """The available text action that runs exactly ``primitive`` (pickup/done: on the object in front)."""
    name = _SINGLE_PRIMITIVE_ACTIONS.get(primitive)
    if name is not None:
        if name in env.available_actions:
            return name
    else:
        prefix = "pickup " if primitive == Actions.pickup else "go to "
        for action, primitives in env.available_actions.items():
            if action.startswith(prefix) and primitives == [primitive]:
                return action
    raise EnvError(f"the BabyAI bot's primitive {Actions(primitive).name!r} has no available text action "
                   f"(available: {', '.join(env.available_actions)})")


Pose = tuple[tuple[int, int], int]


def _pose_of(game: Any) -> Pose:
    return (int(game.agent_pos[0]), int(game.agent_pos[1])), int(game.agent_dir)


def _progress(instr: Any) -> tuple[Any, ...]:
    """What the mission verifier remembers: which parts of a sequence are done (action clauses keep nothing)."""
    if isinstance(instr, SeqInstr):
        return instr.a_done, instr.b_done, _progress(instr.instr_a), _progress(instr.instr_b)
    return ()


@dataclass
class _BotRun:
    """The bot's completed episode: its primitives and their text actions, and after ``k`` of them
    (``poses[k]``, ``progress[k]``) the agent's pose and the verifier's progress."""

    primitives: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    poses: list[Pose] = field(default_factory=list)
    progress: list[tuple[Any, ...]] = field(default_factory=list)
    score: float = 0.0


def _bot(game: Any) -> BabyAIBot:
    """A bot for the ``game`` as it is now. In the ``PutNext...Carrying`` levels the agent starts with the object
    to move in hand, which the bot's plan (go to it, pick it up, go next to the other, drop) cannot find: its
    first two subgoals are dropped, leaving "go next to the other object, drop"."""
    bot = BabyAIBot(game)
    instrs, carrying = game.unwrapped.instrs, game.unwrapped.carrying
    if (carrying is not None and isinstance(instrs, PutNextInstr) and carrying in instrs.desc_move.obj_set
            and isinstance(bot.stack[-1], GoNextToSubgoal) and isinstance(bot.stack[-2], PickupSubgoal)):
        del bot.stack[-2:]
    return bot


class _BotCycleError(RuntimeError):
    """The bot kept replanning without choosing an action."""


_SEARCHES_PER_MOVE = 1000
"""Path searches the bot may run to choose one action (a handful normally): it can cycle between subgoals without
ever acting (it does in task 188, ``UnlockToUnlock`` seed 4, after its first move)."""


def _bounded_replan(bot: BabyAIBot) -> int:
    """The bot's next primitive; ``_BotCycleError`` after ``_SEARCHES_PER_MOVE`` path searches without one."""
    search, limit = bot._breadth_first_search, bot.bfs_counter + _SEARCHES_PER_MOVE

    def bounded_search(*args: Any, **kwargs: Any) -> Any:
        if bot.bfs_counter >= limit:
            raise _BotCycleError(f"no action after {_SEARCHES_PER_MOVE} path searches")
        return search(*args, **kwargs)

    bot._breadth_first_search = bounded_search
    try:
        return int(bot.replan())
    finally:
        del bot._breadth_first_search  # the class's method again


def _bot_run(data_idx: int) -> _BotRun:
    """The bot's episode, played through the text layer one primitive at a time; ``EnvError`` unless it completes
    the mission (in time or not).

    Boxes that hide something (``KeyInBox``: the key to the door) are opened first - the bot walks to each, then
    it is toggled - since the bot cannot plan with objects it cannot see and gives up when a box opens."""
    env = BabyAIEnv()
    try:
        env.reset(data_idx)
        game = env.game.unwrapped
        run = _BotRun(poses=[_pose_of(game)], progress=[_progress(game.instrs)])

        def play(primitive: int) -> None:
            text = _text_for(env, primitive)
            env.step(text)
            run.primitives.append(primitive)
            run.texts.append(text)
            run.poses.append(_pose_of(game))
            run.progress.append(_progress(game.instrs))

        def advice(bot: BabyAIBot) -> int:
            try:
                return _bounded_replan(bot)
            except Exception as error:  # the bot's give-ups (assertions, DisappearedBoxError) and endless cycles
                raise EnvError(f"the BabyAI bot cannot solve task {data_idx} ({task_of(data_idx)[0]}): "
                               f"{type(error).__name__}: {error}") from error

        for box in [obj for obj in game.grid.grid if obj is not None and obj.type == "box" and obj.contains]:
            walker = BabyAIBot(env.game)
            walker.stack = [GoNextToSubgoal(walker, box)]
            while not env.done and (primitive := advice(walker)) != Actions.done:
                play(primitive)
            play(int(Actions.toggle))
        bot = _bot(env.game)
        while not env.done:
            play(advice(bot))
        if env.score <= 0:
            raise EnvError(f"the BabyAI bot ran out of steps on task {data_idx} ({task_of(data_idx)[0]})")
        run.score = env.score
        return run
    finally:
        env.close()


def _walk(pose: Pose, primitives: list[int]) -> Pose:
    """Dead reckoning of turns and forward moves (all of which succeed along a path through standable cells)."""
    (x, y), direction = pose
    for primitive in primitives:
        if primitive == Actions.left:
            direction = (direction - 1) % 4
        elif primitive == Actions.right:
            direction = (direction + 1) % 4
        else:
            dx, dy = ((1, 0), (0, 1), (-1, 0), (0, -1))[direction]
            x, y = x + dx, y + dy
    return (x, y), direction


def _shortcut(env: BabyAIEnv, run: _BotRun, at: int) -> tuple[str, int] | None:
    """The listed composite action that stands for the most of the bot's primitives from ``at``, and the index
    the bot's plan resumes at; ``None`` if none stands for two or more. A composite stands for primitives
    ``at..resume+len(tail)`` when its walk ends in the bot's pose after the bot's walk ``at..resume`` (turns and
    moves only, in which the mission made no progress), its tail (pickup, or toggle and forward) is the bot's
    next primitives, and it is no longer than they are."""
    walked = at
    while walked < len(run.primitives) and run.primitives[walked] in _MOVES:
        walked += 1
    pose = run.poses[at]
    best: tuple[str, int] | None = None
    for action, primitives in env.available_actions.items():
        if len(primitives) < 2:
            continue
        path_length = next((k for k, p in enumerate(primitives) if p not in _MOVES), len(primitives))
        tail = primitives[path_length:]
        end = _walk(pose, primitives[:path_length])
        resume = next((k for k in range(walked, at - 1, -1) if run.poses[k] == end), None)
        if resume is None or run.progress[resume] != run.progress[at]:
            continue
        covered = resume + len(tail) - at
        if (run.primitives[resume:resume + len(tail)] == tail and len(primitives) <= covered
                and covered > (1 if best is None else best[1] - at)):
            best = (action, resume + len(tail))
    return best


def oracle(data_idx: int) -> list[str]:
    """Text actions that solve task ``data_idx``: the bot's plan, shortened by composite actions where they stand
    for its walks (kept if its replay succeeds, else the primitive plan); ``EnvError`` when the bot cannot solve
    the task."""
    run = _bot_run(data_idx)
    env = BabyAIEnv()
    try:
        env.reset(data_idx)
        shortened: list[str] = []
        at = 0
        while at < len(run.primitives) and not env.done:
            shortcut = _shortcut(env, run, at)
            action, at = shortcut if shortcut else (run.texts[at], at + 1)
            shortened.append(action)
            env.step(action)
        if env.done and env.score >= SUCCESS_REWARD:
            return shortened
    finally:
        env.close()
    if run.score < SUCCESS_REWARD:
        raise EnvError(f"the BabyAI bot completed task {data_idx} ({task_of(data_idx)[0]}) too late to count as a "
                       f"success: reward {run.score:.3f} < {SUCCESS_REWARD}")
    return run.texts


def spec() -> EnvSpec:
    """The ``babyai`` environment kind."""
    factory: Callable[[], Environment] = BabyAIEnv
    return EnvSpec(
        name="babyai", factory=factory, splits=dict(SPLITS), instruction=INSTRUCTION, action_format="react",
        success_reward=SUCCESS_REWARD, max_turns=MAX_TURNS, oracle=oracle,
        meta={"levels": list(LEVELS), "source": "AgentGym agentenv-babyai over minigrid BabyAI"},
    )
