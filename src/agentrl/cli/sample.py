"""`agentrl sample`: a sampler process (claims Task slots, rolls out, scores, runs group stages)."""

from __future__ import annotations

import argparse

from agentrl.cli.options import add_db_option, bool_flag

PENALTY_HELP = ("logprobs returned by the engine then come from the penalised distribution while the trainer's "
                "assume the policy's own, which biases the importance ratio (a warning on the train split)")


def add_sampling_flags(group: argparse._ArgumentGroup, defaults: str) -> None:
    """``--temperature``, ``--top_p``, ``--top_k``, ``--min_p``, the penalties and ``--preferred_sampling_params``
    (shared with ``agentrl eval``). All are sent with every request, so a server's own defaults never apply."""
    group.add_argument("--temperature", type=float, default=None, help="0: greedy")
    group.add_argument("--top_p", type=float, default=None)
    group.add_argument("--top_k", type=int, default=None, help="-1: no top-k limit")
    group.add_argument("--min_p", type=float, default=None)
    group.add_argument("--presence_penalty", type=float, default=None, metavar="F",
                       help="subtract F from the logit of every token already generated (default 0); " + PENALTY_HELP)
    group.add_argument("--frequency_penalty", type=float, default=None, metavar="F",
                       help="subtract F per earlier occurrence of a generated token (default 0); " + PENALTY_HELP)
    group.add_argument("--preferred_sampling_params", default=None, metavar="JSON",
                       help="values of temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty for "
                            f"the flags not given (default: {defaults}); a flag that disagrees is an error")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="run a sampler process",
                       description="Claim Task sample slots from the database and roll them out against the live "
                                   "inference services; stops cleanly on SIGTERM/SIGINT.")
    add_db_option(p)
    p.add_argument("--model_name_or_path", default=None,
                   help="tokenizer and chat template of the policy (default: the embedded SmolLM2 model)")
    p.add_argument("--split", default="train")
    p.add_argument("--sampler_id", default=None, help="lease owner name (default: host:pid:random)")
    g = p.add_argument_group("rollout")
    g.add_argument("--max_turns", type=int, default=8)
    g.add_argument("--max_new_tokens", type=int, default=512, help="tokens generated per LLM call")
    g.add_argument("--max_prompt_tokens", type=int, default=4096, help="context limit of a prompt")
    add_sampling_flags(g, '{"temperature": 1, "top_p": 1, "min_p": 0, "top_k": -1}')
    g.add_argument("--seed", type=int, default=None, help="seed the engine's sampling (reproducible runs)")
    g.add_argument("--query_prompt", default="{query}", help="user prompt template with {query}")
    g.add_argument("--new_context", choices=("disabled", "discard_all_tools", "discard_all"), default="disabled",
                   help="what to do when the context outgrows --max_prompt_tokens")
    g.add_argument("--repetition_early_stop_times", type=int, default=0,
                   help="end a trajectory whose output repeats this many times (0: never)")
    g.add_argument("--tool_call_parser", default="qwen", help="qwen | hermes | openai | minicpm")
    g.add_argument("--tool_timeout", type=float, default=60.0, help="seconds per tool call")
    t = p.add_argument_group("tools and scorers")
    t.add_argument("--mcp_config", default=None, help="JSON/YAML file listing MCP servers (stdio command or URL)")
    t.add_argument("--mcp_manager_url", default=None, help="HTTP aggregator, e.g. http://localhost:8000/mcpapi")
    t.add_argument("--mcp_server_name", default=None, help="only these servers (comma-separated)")
    t.add_argument("--mcp_auth_token", default=None, help="bearer token of the aggregator")
    t.add_argument("--agent_config_path", default=None,
                   help="YAML with the LLM judge (scorer_agent) and summariser (browse_agent) endpoints")
    t.add_argument("--scorer_module", action="append", default=[],
                   help="Python file registering scorers with MCPScorerFactory.register_scorer (repeatable)")
    t.add_argument("--env_server", action="append", default=[], metavar="NAME=URL",
                   help="AgentGym environment server of environment NAME (ours: `agentrl envs serve NAME`, or "
                        "AgentGym's own), repeatable; a built-in environment without one gets a local server")
    c = p.add_argument_group("concurrency and admission control")
    c.add_argument("--max_concurrent_samples_per_process", type=int, default=8)
    c.add_argument("--target_concurrency", type=int, default=32, help="max in-flight requests per service")
    c.add_argument("--inference_urls", default=None,
                   help="comma-separated SGLang URLs to register and health-check (engines register themselves)")
    c.add_argument("--request_timeout", type=float, default=600.0)
    c.add_argument("--lease_s", type=float, default=60.0, help="lease duration; heartbeats every third of it")
    c.add_argument("--max_staleness", type=int, default=1,
                   help="admission control (train split): start a new group only while the slots of the groups "
                        "being sampled plus the ready, untrained samples fit (max_staleness + 1) × train_batch_size")
    c.add_argument("--train_batch_size", type=int, default=16, help="samples per trainer step (admission control)")
    c.add_argument("--exit_when_done", type=bool_flag, default=False,
                   help="exit once the split has no open Task left")
    c.add_argument("--max_consecutive_failures", type=int, default=None, metavar="N",
                   help="exit with an error after N trajectories in a row failed for infrastructure (inference, "
                        "environment, judge or database unavailable, aborted generation, environment error); "
                        "default: 4 × --max_concurrent_samples_per_process; 0: never")
    k = p.add_argument_group("rounds and curriculum (train split)")
    k.add_argument("--rounds", type=int, default=1,
                   help="rounds each Task's group is sampled in: the group stage of round r creates the Task of the "
                        "next round it is sampled in; claims take Tasks by round, then upload order (default 1)")
    k.add_argument("--curriculum", choices=("pass_rate", "none"), default="pass_rate",
                   help="pass_rate: a Task whose last group was all solved or all failed (zero reward variance) skips "
                        "each next round with probability 1 - --curriculum_revisit_prob; none: every round samples "
                        "every Task (default pass_rate; it acts from round 2 on)")
    k.add_argument("--curriculum_revisit_prob", type=float, default=0.1,
                   help="with --curriculum pass_rate: the chance that such a Task is sampled in each next round "
                        "(seeded by --seed, reproducible)")
    r = p.add_argument_group("group stage and advantages")
    r.add_argument("--zero_variance_threshold", type=float, default=0.1)
    r.add_argument("--balance_sample", type=bool_flag, default=False)
    r.add_argument("--min_turns", type=int, default=0)
    r.add_argument("--efficient_rewarding", type=bool_flag, default=False)
    r.add_argument("--reserve_context_error_count", type=int, default=-1)
    r.add_argument("--scale_rewards", type=bool_flag, default=False,
                   help="divide advantages by the group's unbiased (n-1) reward std; a group of one gets 0")
    r.add_argument("--leave_one_out", type=bool_flag, default=False)
    r.add_argument("--adv_scaling", type=float, default=1.0)
    r.add_argument("--drop_zero_advantage", type=bool_flag, default=True)
    r.add_argument("--minimal_advantage", type=float, default=None)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The sampler's configuration; raises ``SamplingFlagsError`` when sampling flags contradict each other."""
    from agentrl.rollout.config import (
        PREFERRED_KEYS,
        SAMPLER_SAMPLING_DEFAULTS,
        GroupConfig,
        SamplerConfig,
        resolve_sampling,
    )
    from agentrl.rollout.curriculum import CurriculumConfig
    from agentrl.trajectory.advantages import AdvantageConfig

    group = GroupConfig(zero_variance_threshold=args.zero_variance_threshold, balance_sample=args.balance_sample,
                        min_turns=args.min_turns, efficient_rewarding=args.efficient_rewarding,
                        reserve_context_error_count=args.reserve_context_error_count)
    advantage = AdvantageConfig(scale_rewards=args.scale_rewards, leave_one_out=args.leave_one_out,
                                adv_scaling=args.adv_scaling, drop_zero_advantage=args.drop_zero_advantage,
                                minimal_advantage=args.minimal_advantage)
    curriculum = CurriculumConfig(rounds=args.rounds, mode=args.curriculum, revisit_prob=args.curriculum_revisit_prob,
                                  seed=args.seed or 0)
    sampling = resolve_sampling({k: getattr(args, k) for k in PREFERRED_KEYS}, args.preferred_sampling_params,
                                SAMPLER_SAMPLING_DEFAULTS)
    skip = {"func", "command", "verbose", "inference_urls", "zero_variance_threshold", "balance_sample",
            "min_turns", "efficient_rewarding", "reserve_context_error_count", "scale_rewards", "leave_one_out",
            "adv_scaling", "drop_zero_advantage", "minimal_advantage", "preferred_sampling_params", "rounds",
            "curriculum", "curriculum_revisit_prob", *PREFERRED_KEYS}
    fields = {k: v for k, v in vars(args).items() if k not in skip}
    urls = [u.strip() for u in (args.inference_urls or "").split(",") if u.strip()]
    return SamplerConfig(**fields, **sampling, inference_urls=urls, group=group, advantage=advantage,
                         curriculum=curriculum)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from pydantic import ValidationError

    from agentrl.envs.pool import parse_env_servers
    from agentrl.rollout.config import SamplingFlagsError
    from agentrl.rollout.process import run_sampler
    from agentrl.rollout.sampler import SamplerHalted
    from agentrl.scoring import ScorerError
    from agentrl.scoring.agent_config import AgentConfigError
    from agentrl.tools.errors import ToolConfigError

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional (not available on Windows)
        loop_factory = None
    try:
        config = config_from_args(args)
        parse_env_servers(config.env_server)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            stats = runner.run(run_sampler(config))
    except (ValidationError, SamplingFlagsError, ToolConfigError, AgentConfigError, ScorerError,
            FileNotFoundError, ValueError) as error:
        print(f"agentrl sample: error: {error}", file=sys.stderr)
        return 2
    except SamplerHalted as error:
        print(f"agentrl sample: error: {error}", file=sys.stderr)
        return 1
    print(f"sampler done: {stats.trajectories} trajectories, {stats.scored} scored, {stats.score_errors} scoring "
          f"errors, {stats.group_stages} group stages, {stats.samples_queued} samples queued; outcomes "
          + (", ".join(f"{k} {v}" for k, v in sorted(stats.outcomes.items())) or "none")
          + f"; database commands per trajectory: {stats.median_trajectory_commands or 0:g} (median) from its claim "
            f"to its settlement, {stats.commands_per_trajectory():.1f} in all (admission control, group stages, "
            "polling)")
    return 0
