"""ScienceWorld (AgentGym's SciWorld): elementary science tasks in a text world, on the PyPI ``scienceworld`` package.

Tasks are AgentGym's: every (task, variation) pair of ScienceWorld's tasks in the package's order, variations in
order, except tasks 5-1, 5-2 (growing plants), 9-1..9-3 (inclined planes) and 10-1, 10-2 (Mendelian genetics):
4,639 tasks with scienceworld 1.2.3. ``data_idx`` is the position in that list, so it names the same task as in
AgentGym. The list comes from the package's ``tasks.json`` and, for scienceworld 1.2.3, a pinned table of each
task's number of variations (:data:`VARIATIONS`), so building it starts no JVM; for another release a JVM is asked
once per process, on the first :func:`spec` call (about a second).

``reset(data_idx)`` loads the task, takes the action ``look around`` and returns the task description, a newline
and what that look shows — exactly what AgentGym's client builds from its server's separate fields, so an episode
reads the same over HTTP (ours or AgentGym's) and in process.
``step`` returns the simulator's observation, the change of the score this step and ScienceWorld's ``done`` (task
completed or failed, or more than 100 moves), with the cumulative score (0..100) as ``info["score"]``; an episode
whose rewards sum to 100 is a success, and the Record's score is that sum / 100. Some tasks give points for where
the agent starts (the score after the reset's ``look around`` is above 0); the first step's reward includes them,
so an episode's rewards always sum to its final score.

The score: ScienceWorld sets it to -100 when the agent fails the task irrecoverably (for instance focusing on the
wrong object), and ends the episode. AgentGym passes that through; here the score is clamped at 0 (the failing
step's reward takes back what was earned), so an episode's total reward is its final score in [0, 100] and the
Record's score is in [0, 1]. The simulator's own score is ``info["raw_score"]``.

Every instance runs its own JVM (started by the factory, about a second); ``close()`` stops it and waits for the
java process to exit. A step takes about 70 ms, most of it the package listing every valid action after each step.

Splits: ScienceWorld's own train/dev/test split (by variation within each task: the first half train, the next
quarter dev, the last quarter test) interleaves in AgentGym's order, so the splits here are by task instead:
``test`` is the contiguous tail from task 6-1 (tasks 6-1..8-2: chemistry mixing, lifespans, life stages; 503
tasks, ``range(4136, 4639)``) and ``train`` the rest (tasks 1-1..4-4; ``range(0, 4136)``). The test split thus
holds task types never trained on.

The oracle (:class:`GoldPaths`) is ScienceWorld's gold action sequence of the task, to be played until ``done``
(it often goes on after the task is complete). It does not complete every task: not those that need more than
ScienceWorld's 100 moves (some state-of-matter tasks, whose ``wait`` takes 10 moves), nor a few whose generated
sequence fails (it varies from one generation to the next, e.g. test-conductivity variation 616; and
measure-melting-point-unknown-substance variation 60 always fails), nor, rarely, one whose outcome differs in the
replaying JVM. Played on a second instance, it completed 137 of 138 sampled tasks (6 variations of each task),
128 of them within ``MAX_TURNS``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from py4j.protocol import Py4JError
from scienceworld import ScienceWorldEnv

from agentrl.envs.base import EnvError, Environment, EnvSpec, StepResult

NAME = "sciworld"
EXCLUDED_TASKS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
"""Task ids AgentGym leaves out."""
FIRST_TEST_TASK = "6-1"
"""The test split: this task and every task after it."""
SUCCESS_SCORE = 100
MAX_TURNS = 50
"""Gold sequences complete their task in 3 to 99 actions (median 17; 104 of 137 within 30, 128 within 50), in a
sample of 6 variations of every task; AgentGym evaluates SciWorld with 30 rounds. Gold sequences are not short
(they look around often), so 50 leaves a capable agent room on the long state-of-matter tasks."""
JVM_EXIT_TIMEOUT_S = 10.0

INSTRUCTION = (
    "You are an agent in a text-based science world: rooms, objects, substances, devices, plants and animals. "
    "A task is given first; carry it out by acting in the world. Each message you receive is what you observe.\n"
    "Actions (OBJ is an object or place as the observations name it):\n"
    "- look around; look at OBJ; look in OBJ; inventory; task (repeat the task)\n"
    "- go to OBJ (a room you can reach through an open door); open OBJ; close OBJ\n"
    "- pick up OBJ; put down OBJ; move OBJ to OBJ; pour OBJ in OBJ; dunk OBJ in OBJ; mix OBJ\n"
    "- activate OBJ; deactivate OBJ; use OBJ on OBJ; connect OBJ to OBJ; disconnect OBJ\n"
    "- eat OBJ; flush OBJ; read OBJ\n"
    "- focus on OBJ: mark the object the task is about (focusing on the wrong object fails the task)\n"
    "- wait (ten steps of time) or wait1 (one step)\n"
    "When an action is ambiguous you are shown numbered choices; answer with the number.\n"
    "Take one action per turn. Reply in this format:\n"
    "Thought: <your reasoning>\n"
    "Action: <one action>"
)


@dataclass(frozen=True)
class SciWorldTask:
    """One task: a ScienceWorld task and one of its variations."""

    task_id: str
    """ScienceWorld's id, e.g. ``1-1``"""
    task_name: str
    """the simulator's name, e.g. ``boil``"""
    variation: int


def _start() -> ScienceWorldEnv:
    """A new simulator in its own JVM."""
    try:
        return ScienceWorldEnv()
    except (OSError, Py4JError) as error:
        raise EnvError(f"sciworld: cannot start ScienceWorld's JVM (it needs a Java runtime on PATH): {error}") \
            from error


VARIATIONS: dict[str, dict[str, int]] = {"1.2.3": {
    "1-1": 30, "1-2": 30, "1-3": 30, "1-4": 30, "2-1": 540, "2-2": 436, "2-3": 300, "3-1": 20, "3-2": 20, "3-3": 900,
    "3-4": 600, "4-1": 300, "4-2": 300, "4-3": 300, "4-4": 300, "6-1": 32, "6-2": 36, "6-3": 36, "7-1": 125,
    "7-2": 125, "7-3": 125, "8-1": 14, "8-2": 10}}
"""Variations per (not excluded) task of a scienceworld release, as its JVM reports them, so building the task list
needs no JVM (a sampler whose SciWorld server runs elsewhere needs no Java); other releases are asked at run time.
``tests/test_envs_sciworld.py`` checks the table against the JVM."""


def _list_tasks(*, ask_the_jvm: bool = False) -> tuple[SciWorldTask, ...]:
    from scienceworld.version import __version__

    known = None if ask_the_jvm else VARIATIONS.get(__version__)
    if known is None:
        simulator = _start()
        try:
            counts = {task_id: simulator.get_max_variations(name) for task_id, name in simulator.tasks.items()}
            names = dict(simulator.tasks)
        finally:
            _stop(simulator)
    else:
        listed = json.loads((importlib.resources.files("scienceworld") / "tasks.json").read_text())
        names = {task["task_id"]: task["task_name"] for task in listed}
        counts = known
    return tuple(SciWorldTask(task_id, name, variation) for task_id, name in names.items()
                 if task_id not in EXCLUDED_TASKS for variation in range(counts[task_id]))


_tasks: tuple[SciWorldTask, ...] | None = None
_tasks_lock = threading.Lock()


def sciworld_tasks() -> tuple[SciWorldTask, ...]:
    """The task list (see the module docstring), built on first use and kept for the process."""
    global _tasks
    with _tasks_lock:
        if _tasks is None:
            _tasks = _list_tasks()
        return _tasks


def _stop(simulator: ScienceWorldEnv) -> None:
    """Shut the simulator's JVM down and wait for the java process to exit (killed if it has not within
    ``JVM_EXIT_TIMEOUT_S``). The package's ``close`` only asks it to exit."""
    process: subprocess.Popen[bytes] = simulator._gateway.java_process
    simulator.close()
    try:
        process.wait(timeout=JVM_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _task(tasks: tuple[SciWorldTask, ...], data_idx: int) -> SciWorldTask:
    if isinstance(data_idx, bool) or not isinstance(data_idx, int) or not 0 <= data_idx < len(tasks):
        raise EnvError(f"sciworld task index {data_idx!r} is out of range: expected an integer in [0, {len(tasks)})")
    return tasks[data_idx]


class SciWorldEnv(Environment):
    """One ScienceWorld simulator (its own JVM), one episode at a time (see the module docstring)."""

    def __init__(self, tasks: tuple[SciWorldTask, ...]) -> None:
        self.tasks = tasks
        self._simulator: ScienceWorldEnv | None = _start()
        self.task: SciWorldTask | None = None
        self.data_idx: int | None = None
        self.task_description = ""
        self.first_look = ""
        self.score = 0
        """the current score, clamped at 0"""
        self._credited = 0
        """the rewards returned so far this episode, summed"""
        self.done = False
        self._observation = ""
        self._seen = ""
        """what the agent's room and inventory show now (ScienceWorld's free look and inventory)"""

    def _running(self) -> ScienceWorldEnv:
        if self._simulator is None:
            raise EnvError("sciworld instance is closed")
        return self._simulator

    def reset(self, data_idx: int) -> str:
        simulator = self._running()
        task = _task(self.tasks, data_idx)
        simulator.load(task.task_name, task.variation)
        self.task, self.data_idx = task, data_idx
        self.task_description = simulator.get_task_description()
        self.first_look, _, _, info = simulator.step("look around")
        self.score, self._credited = max(info["score"], 0), 0
        self.done = False
        self._observation = f"{self.task_description}\n{self.first_look}"
        self._seen = f"{info['look']}\n{info['inv']}"
        return self._observation

    def step(self, action: str) -> StepResult:
        simulator = self._running()
        if self.task is None:
            raise EnvError("sciworld: step before reset: reset a task first")
        if self.done:
            raise EnvError(f"sciworld task {self.data_idx} has finished: reset it to play again")
        observation, _, done, info = simulator.step(action)
        raw_score = info["score"]
        self.score = max(raw_score, 0)
        reward, self._credited = self.score - self._credited, self.score
        self.done, self._observation = bool(done), observation
        self._seen = f"{info['look']}\n{info['inv']}"
        return StepResult(observation=observation, reward=float(reward), done=self.done,
                          info={"score": self.score, "raw_score": raw_score, "moves": info["moves"]})

    def observation(self) -> str:
        return self._observation

    def state_key(self) -> str | None:
        """The task and variation, the score so far, and what the agent's room and inventory show (ScienceWorld's
        free look and inventory, taken by every step): an action's feedback alone ("The door is now open.") says
        neither where the agent is nor what it holds. Not the number of moves, which would make every state new;
        not the rooms out of sight."""
        if self.task is None:
            return None
        seen = hashlib.sha256(self._seen.encode()).hexdigest()[:24]
        return f"{self.task.task_id}:{self.task.variation}|score {self.score}|{seen}"

    def close(self) -> None:
        if self._simulator is not None:
            simulator, self._simulator = self._simulator, None
            _stop(simulator)

    def detail(self) -> dict[str, Any]:
        if self.task is None:
            return {}
        return {
            "data_idx": self.data_idx,
            "task_id": self.task.task_id,
            "task_name": self.task.task_name,
            "var_num": self.task.variation,
            "task_description": self.task_description,
            "observation": self.first_look,
            "score": self.score,
            "done": self.done,
        }


class GoldPaths:
    """The oracle: ScienceWorld's gold action sequence of a task, which the simulator writes when it loads the task
    (in this oracle's own JVM, started on first use; calls are serialised; :meth:`close` stops it).

    The sequence often goes on after the task is complete: play it until ``done``. It is not cut here, because
    where the task completes can differ by a step between JVMs (the electrical tasks' circuits take effect one
    tick earlier or later), and a trailing ``wait1`` is then what completes it."""

    def __init__(self, tasks: tuple[SciWorldTask, ...]) -> None:
        self.tasks = tasks
        self._simulator: ScienceWorldEnv | None = None
        self._lock = threading.Lock()

    def __call__(self, data_idx: int) -> list[str]:
        task = _task(self.tasks, data_idx)
        with self._lock:
            if self._simulator is None:
                self._simulator = _start()
            self._simulator.load(task.task_name, task.variation, "", generateGoldPath=True)
            return self._simulator.get_gold_action_sequence()

    def close(self) -> None:
        with self._lock:
            if self._simulator is not None:
                simulator, self._simulator = self._simulator, None
                _stop(simulator)


def spec() -> EnvSpec:
    tasks = sciworld_tasks()
    first_test = next(i for i, task in enumerate(tasks) if task.task_id == FIRST_TEST_TASK)
    return EnvSpec(
        name=NAME,
        factory=lambda: SciWorldEnv(tasks),
        splits={"train": range(0, first_test), "test": range(first_test, len(tasks))},
        instruction=INSTRUCTION,
        action_format="react",
        success_reward=SUCCESS_SCORE,
        reward_scale=1 / SUCCESS_SCORE,
        max_turns=MAX_TURNS,
        oracle=GoldPaths(tasks),
        meta={"task_type": lambda data_idx: f"{NAME}-{_task(tasks, data_idx).task_name}",
              "source": "AgentGym agentenv-sciworld over scienceworld"},
    )
