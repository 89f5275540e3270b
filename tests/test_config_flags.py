"""Flags generated from the configuration models (agentrl.config_flags): `agentrl sample` and `agentrl eval` keep
the flag names and command lines users type, and both build their rollout from the same declarations."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agentrl.cli.eval import config_from_args as eval_config
from agentrl.cli.main import build_parser
from agentrl.cli.sample import config_from_args as sample_config
from agentrl.config_flags import add_model_arguments, flag_values, given_flags, model_from_namespace, to_argv
from agentrl.eval.runner import EvalConfig, _sampler_config
from agentrl.inference.engine_config import EngineCommandConfig
from agentrl.rollout.config import ConcurrencyConfig, RolloutConfig, SamplerConfig, ToolsConfig
from agentrl.training.config import TrainConfig

# `agentrl sample --help` and `agentrl eval --help` before the flags were generated (hand-written argparse).
SAMPLE_FLAGS = {
    "--adv_estimator", "--adv_scaling", "--agent_config_path", "--allow_biased_sampling", "--balance_sample",
    "--curriculum",
    "--curriculum_by_type",
    "--curriculum_revisit_prob",
    "--db_connection_string", "--drop_zero_advantage", "--efficient_rewarding", "--env_server", "--exit_when_done",
    "--frequency_penalty", "--gamma", "--gigpo_mode", "--help", "--inference_urls", "--lease_s", "--leave_one_out",
    "--max_concurrent_samples_per_process", "--max_consecutive_failures", "--max_new_tokens", "--max_prompt_tokens",
    "--max_staleness", "--max_turns", "--mcp_auth_token", "--mcp_config", "--mcp_manager_url", "--mcp_server_name",
    "--min_p", "--min_turns", "--minimal_advantage", "--model_name_or_path", "--new_context",
    "--preferred_sampling_params", "--presence_penalty", "--query_prompt", "--repetition_early_stop_times",
    "--request_timeout", "--reserve_context_error_count", "--rounds", "--sampler_id", "--scale_rewards",
    "--scorer_module", "--seed", "--split", "--step_advantage_w", "--target_concurrency", "--temperature",
    "--tool_call_parser", "--tool_timeout", "--top_k", "--top_p", "--train_batch_size", "--zero_variance_threshold",
    "-h"}
EVAL_FLAGS = {
    "--agent_config_path", "--answer_schema", "--db_connection_string", "--engine_args", "--env_server", "--force",
    "--frequency_penalty", "--help", "--inference_urls", "--json", "--lease_s", "--limit", "--max_attempts",
    "--max_concurrent_samples_per_process", "--max_new_tokens", "--max_prompt_tokens", "--max_turns",
    "--mcp_auth_token", "--mcp_config", "--mcp_manager_url", "--mcp_server_name", "--min_p", "--model_name_or_path",
    "--name", "--new_context", "--num_samples_per_task", "--output", "--preferred_sampling_params",
    "--presence_penalty", "--query_prompt", "--repeats", "--repetition_early_stop_times", "--request_timeout",
    "--scorer", "--scorer_module", "--seed", "--split", "--target_concurrency", "--tasks", "--temperature",
    "--tool_call_parser", "--tool_timeout", "--top_k", "--top_p", "-h", "-k"}

# A value for every field of the shared models, none of them a default of either command.
SHARED_FLAGS = [
    "--max_turns", "5", "--max_new_tokens", "77", "--max_prompt_tokens", "3000", "--temperature", "0.6",
    "--top_p", "0.9", "--top_k", "20", "--min_p", "0.05", "--presence_penalty", "0.1", "--frequency_penalty", "0.2",
    "--seed", "7", "--query_prompt", "Q: {query}", "--new_context", "discard_all", "--repetition_early_stop_times",
    "3", "--tool_call_parser", "hermes", "--tool_timeout", "12.5", "--mcp_config", "mcp.json", "--mcp_manager_url",
    "http://127.0.0.1:9/mcpapi", "--mcp_server_name", "a,b", "--mcp_auth_token", "t0k", "--agent_config_path",
    "agent.yaml", "--scorer_module", "a.py", "--scorer_module", "b.py", "--env_server", "textcraft=http://h:1",
    "--env_server", "babyai=http://h:2", "--max_concurrent_samples_per_process", "3", "--target_concurrency", "5",
    "--request_timeout", "30", "--lease_s", "9"]


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("command", "expected"), [("sample", SAMPLE_FLAGS), ("eval", EVAL_FLAGS)])
def test_generated_flags_are_the_hand_written_ones(command: str, expected: set[str]) -> None:
    flags = {option for action in _subparser(command)._actions for option in action.option_strings}
    assert flags == expected


def test_a_sampler_and_an_evaluation_of_the_same_flags_agree_on_every_rollout_field() -> None:
    sampler = sample_config(_parse("sample", *SHARED_FLAGS, "--allow_biased_sampling", "true"))
    evaluation = eval_config(_parse("eval", "--tasks", "t.jsonl", *SHARED_FLAGS))
    for name, model in (("rollout", RolloutConfig), ("tools", ToolsConfig), ("concurrency", ConcurrencyConfig)):
        ours, theirs = getattr(sampler, name), getattr(evaluation, name)
        assert ours.model_dump() == theirs.model_dump()
        assert set(ours.model_dump()) == set(model.model_fields)
        assert ours.model_dump() != model().model_dump()  # the flags took effect
    assert sampler.tools.scorer_module == ["a.py", "b.py"]
    assert sampler.tools.env_server == ["textcraft=http://h:1", "babyai=http://h:2"]
    # the evaluation's in-process sampler runs exactly that rollout, tools and concurrency
    inner = _sampler_config(evaluation, "mongodb://127.0.0.1:1/x", "eval:abc", None)
    for name in ("rollout", "tools", "concurrency"):
        assert getattr(inner, name).model_dump() == getattr(sampler, name).model_dump()


def test_defaults_differ_only_where_each_command_says() -> None:
    sampler, evaluation = SamplerConfig(), EvalConfig()
    differing = {k for k, v in sampler.rollout.model_dump().items() if evaluation.rollout.model_dump()[k] != v}
    assert differing == {"temperature", "seed"}  # eval: greedy and seeded
    assert (evaluation.rollout.temperature, evaluation.rollout.seed) == (0.0, 0)
    assert sampler.concurrency.max_concurrent_samples_per_process == 8
    assert evaluation.concurrency.max_concurrent_samples_per_process == 16
    assert eval_config(_parse("eval", "--tasks", "t.jsonl")).rollout.temperature == 0.0


def test_command_lines_users_type_keep_working() -> None:
    config = sample_config(_parse(
        "sample", "--inference_urls", "http://a:1, http://b:2", "--exit_when_done", "true", "--balance_sample",
        "false", "--drop_zero_advantage", "false", "--curriculum", "none", "--curriculum_revisit_prob", "0.5",
        "--rounds", "3", "--seed", "4", "--minimal_advantage", "0.1", "--max_staleness", "0",
        "--preferred_sampling_params", '{"temperature": 0.7, "top_k": 5}', "--allow_biased_sampling", "true"))
    # (top-k on the train split needs --allow_biased_sampling: test_rollout_standin's refusal test)
    assert config.inference_urls == ["http://a:1", "http://b:2"]
    assert config.exit_when_done and not config.group.balance_sample and not config.advantage.drop_zero_advantage
    assert (config.curriculum.mode, config.curriculum.revisit_prob, config.curriculum.rounds) == ("none", 0.5, 3)
    assert config.curriculum.seed == 4  # the revisit draws follow --seed
    assert (config.rollout.temperature, config.rollout.top_k, config.rollout.top_p) == (0.7, 5, 1.0)
    assert config.max_staleness == 0 and config.advantage.minimal_advantage == 0.1
    evaluation = eval_config(_parse("eval", "--split", "test", "-k", "4", "--engine_args", "--device cpu",
                                    "--force", "--limit", "2"))
    assert (evaluation.num_samples_per_task, evaluation.engine_args) == (4, ["--device", "cpu"])
    assert evaluation.force and evaluation.limit == 2 and evaluation.split == "test"


@pytest.mark.parametrize(("argv", "message"), [
    (["sample", "--max_turns", "0"], "--max_turns: Input should be greater than or equal to 1"),
    (["eval", "--max_turns", "0"], "--max_turns: Input should be greater than or equal to 1"),
    (["sample", "--max_turns", "x"], "argument --max_turns: invalid int value: 'x'"),
    (["sample", "--exit_when_done", "maybe"], "expected true or false, got 'maybe'"),
    (["sample", "--curriculum_revisit_prob", "2"], "--curriculum_revisit_prob: Input should be less than or equal"),
    (["sample", "--temperature", "0.5", "--preferred_sampling_params", '{"temperature": 0.7}'],
     "--temperature 0.5 disagrees with --preferred_sampling_params temperature=0.7"),
    (["eval", "--preferred_sampling_params", '{"beam": 2}'], "unsupported key(s) beam"),
    (["eval", "--answer_schema", "xml"], "--answer_schema: expected one of"),
])
def test_bad_values_are_usage_errors_naming_the_flag(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        (sample_config if argv[0] == "sample" else eval_config)(_parse(*argv))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


class _Recorded(Exception):
    """Stops a stage once the command it runs is recorded."""


class _RecordingProcesses:
    """Records the command lines a stage of `agentrl run` starts instead of starting them."""

    def __init__(self) -> None:
        self.commands: dict[str, list[str]] = {}

    def start(self, name: str, command: list[str], log: object = None) -> None:
        self.commands[name] = command

    def call(self, name: str, command: list[str], log: object = None) -> None:
        self.commands[name] = command
        raise _Recorded

    def call_showing(self, name: str, command: list[str]) -> None:
        self.commands[name] = command
        raise _Recorded


def test_the_command_lines_agentrl_run_builds_parse(tmp_path: Path) -> None:
    from agentrl.run import stages
    from agentrl.run.config import RunConfig

    config = RunConfig(run_name="r", run_dir=tmp_path, query_prompt="Q: {query}", extra_sample_flags="--seed 3",
                       num_eval_tasks=2,
                       extra_eval_flags="--top_p 0.9")
    processes = _RecordingProcesses()
    run = stages.RunState(config=config, processes=processes,  # type: ignore[arg-type]
                          db_base="mongodb://127.0.0.1:1", tools={"mcp_config": "mcp.json"},
                          inference_urls="http://127.0.0.1:2,http://127.0.0.1:3", eval_tasks=tmp_path / "t.jsonl")
    stages.start_samplers(run, "model-dir")
    for stage in (lambda: stages.held_out_eval(run, "start", model_name_or_path="m"),
                  lambda: stages.evaluate(run, tmp_path / "t.jsonl")):
        with pytest.raises(_Recorded):
            stage()
    sampler = sample_config(_parse(*processes.commands["sampler-0"][3:]))
    assert (sampler.train_batch_size, sampler.max_staleness, sampler.rollout.temperature) == (
        config.value("train_batch_size"), config.value("max_staleness"), config.value("temperature"))
    assert sampler.inference_urls == ["http://127.0.0.1:2", "http://127.0.0.1:3"] and sampler.rollout.seed == 3
    held_out = eval_config(_parse(*processes.commands["eval-start"][3:]))
    assert held_out.engine_args == [] and held_out.force  # ENGINE_THREADS unset: the engine's own default
    run.config = config.model_copy(update={"engine": EngineCommandConfig(num_threads=2)})
    with pytest.raises(_Recorded):
        stages.held_out_eval(run, "start", model_name_or_path="m")
    assert eval_config(_parse(*processes.commands["eval-start"][3:])).engine_args == ["--num_threads", "2"]
    assert (held_out.rollout.temperature, held_out.rollout.query_prompt) == (0.0, "Q: {query}")
    evaluation = eval_config(_parse(*processes.commands["eval"][3:]))
    assert evaluation.rollout.top_p == 0.9 and evaluation.tools.mcp_config == "mcp.json"


@pytest.mark.parametrize("model", [SamplerConfig, EvalConfig, TrainConfig])
def test_the_command_line_of_a_configuration_gives_it_back(model: type) -> None:
    """``to_argv(given_flags(config))`` parses to ``config``, with the same flags given (lists, comma lists, shell
    words, repeated flags, booleans, JSON objects and none)."""
    values = {SamplerConfig: {"inference_urls": ["http://a:1", "http://b:2"], "scorer_module": ["a.py", "b py.py"],
                              "allow_biased_sampling": True, "top_k": 5, "max_staleness": None, "rounds": 2,
                              "preferred_sampling_params": {"temperature": 0.5}, "query_prompt": "Q: '{query}'"},
              EvalConfig: {"engine_args": ["--device", "cuda", "--dtype", "a b"], "inference_urls": ["http://a:1"],
                           "force": True, "limit": 3, "temperature": 0.0, "env_server": ["babyai=http://c:3"]},
              TrainConfig: {"report_to": ["tensorboard", "wandb"], "lora_target_modules": ["q_proj", "v_proj"],
                            "use_peft": True, "max_grad_norm": None, "learning_rate": 2e-06, "epsilon": 0.3,
                            "loss_calculater": "MINIRL"}}[model]
    config = model(**flag_values(model, values))
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, model)
    again = model_from_namespace(model, parser.parse_args(to_argv(model, given_flags(config))), parser)
    assert again == config and given_flags(again) == given_flags(config)
    assert values.items() <= given_flags(config).items()  # and what they give: a preferred temperature
