"""`agentrl eval`: evaluate a model (checkpoint directory or live service) on a task file or split."""

from __future__ import annotations

import argparse

from agentrl.cli.options import add_db_option
from agentrl.cli.sample import add_sampling_flags
from agentrl.scoring.answers import ANSWER_SCHEMAS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a model on a task file or split (accuracy, avg@k, pass@k)",
        description="Roll the model out k × R times on every task with the same agent loop, tools and scorers as "
                    "training, then report accuracy, mean reward, avg@k and unbiased pass@k (errors excluded and "
                    "counted), overall and per task type. The result is stored in the run's Eval collection; "
                    "evaluating the same model on the same tasks with the same settings again reuses it unless "
                    "--force.")
    add_db_option(p)
    src = p.add_argument_group("tasks (one of)")
    src.add_argument("--tasks", default=None, metavar="FILE",
                     help="task file, JSON or JSONL (as for `agentrl tasks upload`)")
    src.add_argument("--split", default=None, help="evaluate the Tasks already stored under this split")
    src.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N tasks")
    src.add_argument("--scorer", default="agentcpm", help="scorer of tasks that name none (default: agentcpm)")
    src.add_argument("--answer_schema", choices=ANSWER_SCHEMAS, default="answer",
                     help="answer marker of tasks that name none (default: answer)")
    m = p.add_argument_group("model")
    m.add_argument("--model_name_or_path", default=None,
                   help="model directory to evaluate: an agentrl engine is started on it and stopped afterwards "
                        "(default: the embedded SmolLM2 model); with --inference_urls only its tokenizer")
    m.add_argument("--inference_urls", default=None,
                   help="comma-separated URLs of live SGLang / agentrl engine services serving the model (used "
                        "directly, never registered in the run)")
    m.add_argument("--engine_args", default="",
                   help="extra `agentrl engine` flags, e.g. '--device cuda --dtype bfloat16'")
    m.add_argument("--name", default=None, help="label of this evaluation (default: model and task names)")
    s = p.add_argument_group("sampling")
    s.add_argument("--num_samples_per_task", "-k", type=int, default=1, help="samples per task, k (default: 1)")
    s.add_argument("--repeats", type=int, default=1,
                   help="repeat the k samples R times: pass@k uses all k × R samples, and the spread over repeats "
                        "is reported (default: 1)")
    add_sampling_flags(s, '{"temperature": 0, "top_p": 1, "min_p": 0, "top_k": -1}: greedy decoding')
    s.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling (default: 0)")
    r = p.add_argument_group("rollout")
    r.add_argument("--max_turns", type=int, default=8)
    r.add_argument("--max_new_tokens", type=int, default=512, help="tokens generated per LLM call")
    r.add_argument("--max_prompt_tokens", type=int, default=4096, help="context limit of a prompt")
    r.add_argument("--query_prompt", default="{query}", help="user prompt template with {query}")
    r.add_argument("--new_context", choices=("disabled", "discard_all_tools", "discard_all"), default="disabled")
    r.add_argument("--repetition_early_stop_times", type=int, default=0)
    r.add_argument("--tool_call_parser", default="qwen", help="qwen | hermes | openai | minicpm")
    r.add_argument("--tool_timeout", type=float, default=60.0, help="seconds per tool call")
    r.add_argument("--max_attempts", type=int, default=3, help="attempts per sample slot before it is an error")
    t = p.add_argument_group("tools and scorers")
    t.add_argument("--mcp_config", default=None, help="JSON/YAML file listing MCP servers (stdio command or URL)")
    t.add_argument("--mcp_manager_url", default=None, help="HTTP aggregator, e.g. http://localhost:8000/mcpapi")
    t.add_argument("--mcp_server_name", default=None, help="only these servers (comma-separated)")
    t.add_argument("--mcp_auth_token", default=None, help="bearer token of the aggregator")
    t.add_argument("--agent_config_path", default=None, help="YAML with the LLM judge (scorer_agent) endpoints")
    t.add_argument("--scorer_module", action="append", default=[],
                   help="Python file registering scorers with MCPScorerFactory.register_scorer (repeatable)")
    t.add_argument("--env_server", action="append", default=[], metavar="NAME=URL",
                   help="AgentGym environment server of environment NAME (ours: `agentrl envs serve NAME`, or "
                        "AgentGym's own), repeatable; a built-in environment without one gets a local server")
    c = p.add_argument_group("concurrency")
    c.add_argument("--max_concurrent_samples_per_process", type=int, default=16)
    c.add_argument("--target_concurrency", type=int, default=32, help="max in-flight requests per service")
    c.add_argument("--request_timeout", type=float, default=600.0)
    c.add_argument("--lease_s", type=float, default=60.0)
    o = p.add_argument_group("output")
    o.add_argument("--force", action="store_true", help="recompute even if a stored result matches")
    o.add_argument("--output", default=None, metavar="FILE.json", help="also write the result as JSON")
    o.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The evaluation's configuration; raises ``SamplingFlagsError`` when sampling flags contradict each other."""
    import shlex

    from agentrl.eval.runner import EVAL_SAMPLING_DEFAULTS, EvalConfig
    from agentrl.rollout.config import PREFERRED_KEYS, resolve_sampling

    sampling = resolve_sampling({k: getattr(args, k) for k in PREFERRED_KEYS}, args.preferred_sampling_params,
                                EVAL_SAMPLING_DEFAULTS)
    skip = {"func", "command", "verbose", "inference_urls", "engine_args", "output", "json",
            "preferred_sampling_params", *PREFERRED_KEYS}
    fields = {k: v for k, v in vars(args).items() if k not in skip}
    urls = [u.strip() for u in (args.inference_urls or "").split(",") if u.strip()]
    return EvalConfig(**fields, **sampling, inference_urls=urls, engine_args=shlex.split(args.engine_args or ""))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    from pydantic import ValidationError

    from agentrl.eval.report import render, result_json, write_json
    from agentrl.eval.runner import EvalError, EvalInterrupted, evaluate
    from agentrl.log import redact
    from agentrl.rollout.config import SamplingFlagsError
    from agentrl.scoring import ScorerError
    from agentrl.scoring.agent_config import AgentConfigError
    from agentrl.store.task_files import TaskFileError
    from agentrl.tools.errors import ToolConfigError

    try:
        config = config_from_args(args)
    except (ValidationError, SamplingFlagsError) as error:
        print(f"agentrl eval: error: {error}", file=sys.stderr)
        return 2
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            outcome = runner.run(evaluate(config))
    except TaskFileError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        print(f"agentrl eval: error: {len(error.problems)} problem(s) in the task file; nothing was evaluated",
              file=sys.stderr)
        return 2
    except (EvalError, ToolConfigError, AgentConfigError, ScorerError, OSError, ValidationError) as error:
        print(f"agentrl eval: error: {redact(str(error))}", file=sys.stderr)
        return 2
    except EvalInterrupted as error:
        print(f"agentrl eval: {error}", file=sys.stderr)
        return 130
    except asyncio.CancelledError:  # SIGTERM before or after sampling
        print("agentrl eval: stopped; run the same command again to resume", file=sys.stderr)
        return 130
    data = result_json(outcome.job, reused=outcome.reused, database=outcome.database)
    if args.output:
        write_json(args.output, data)
    if args.json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        render(outcome.job, reused=outcome.reused, database=outcome.database)
        if args.output:
            print(f"result written to {args.output}")
    return 0
