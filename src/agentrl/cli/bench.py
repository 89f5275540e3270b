"""`agentrl bench serve|run|list`: AutoRL-Bench's benchmark server and run orchestrator."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="AutoRL-Bench: scenarios, grading server, agent runs",
                       description="AutoRL-Bench: an agent post-trains a scenario's base model on its training data "
                                   "and submits models, which are graded on held-out data.")
    bench = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)

    ls = bench.add_parser("list", help="the scenarios (built-ins and --scenario files)")
    ls.add_argument("--scenario", action="append", default=[], metavar="FILE.yaml", help="a scenario file (repeatable)")
    ls.set_defaults(func=list_scenarios)

    s = bench.add_parser("serve", help="AutoRL-Bench's scenario API and, with --task, its grading API",
                         description="Serve AutoRL-Bench's scenario API (GET /, /scenarios, /scenarios/ID, POST "
                                     "/evaluate, /interact) and, with --task, its grading API (GET /health, POST "
                                     "/validate, /submit, GET /jobs/ID, /best, /history, POST /set_baseline, GET "
                                     "/time). Evaluations run through `agentrl eval`, one at a time; with --task, "
                                     "every evaluation asked for without the operator's token is a recorded "
                                     "grading of the task.")
    s.add_argument("--task", default=None, help="scenario the grading API grades (e.g. gsm8k, arith, humaneval)")
    s.add_argument("--workspace", default=None, help="the run's workspace (default: workspace/TASK)")
    s.add_argument("--output_dir", default=None, help="default model path of /submit (default: WORKSPACE/output)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5000, help="0: any free port (printed)")
    _add_eval_flags(s)
    s.add_argument("--inference_urls", default=None,
                   help="comma-separated SGLang / agentrl engine services to evaluate on (each submission is "
                        "loaded into them with update_weights_from_disk); default: an engine per evaluation")
    s.add_argument("--env_server", action="append", default=[], metavar="NAME=URL",
                   help="AgentGym server of an environment (default: one started per evaluation)")
    s.add_argument("--state_dir", default=None,
                   help="grading record, model copies, evaluation results and logs (never inside a workspace; "
                        "default: under ~/.cache/agentrl/bench)")
    s.add_argument("--unix_socket", default=None, metavar="PATH", help="also serve on this Unix socket (mode 0600)")
    s.add_argument("--admin_token_env", default=None, metavar="VAR",
                   help="environment variable holding the operator's token: then /set_baseline and unrecorded "
                        "/evaluate calls need 'Authorization: Bearer TOKEN'")
    s.set_defaults(func=serve)

    r = bench.add_parser("run", help="run an agent on a task under a time limit and collect its best model",
                         description="Prepare a workspace (training data only), start the grading server, "
                                     "evaluate the baseline once, run agents/ID/start.sh under --timeout, contained "
                                     "(bubblewrap namespaces: it sees its workspace, the software and the grading "
                                     "API, not the test data; refused where that cannot work, unless "
                                     "--uncontained), then write results/TIME_TASK_AGENT/result.json from the "
                                     "grading server's record and link the best model.")
    r.add_argument("--agent", "--agent_id", "--agent-id", "-a", dest="agent", required=True,
                   help="agent directory name under --agents_dir (e.g. agentrl_grpo, template)")
    r.add_argument("--task", "-t", required=True, help="scenario id")
    r.add_argument("--base_model", "--base-model", "--model", "-m", dest="base_model", default=None,
                   help="base model directory (default: the scenario's, else the embedded SmolLM2-135M-Instruct)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds the agent may run (default: 3600)")
    r.add_argument("--port", type=int, default=5000, help="grading server port (default: 5000)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--workspace_root", default="workspace")
    r.add_argument("--results_dir", default="results")
    r.add_argument("--agents_dir", default=None, help="where agent directories are (default: ./agents, then "
                                                      "the repository's agents/)")
    r.add_argument("--uncontained", action="store_true",
                   help="run the agent as your user without namespaces where containment (bubblewrap) is "
                        "unavailable: it can then read the test data, the grading state and the evaluation database")
    r.add_argument("--agent_network", choices=("isolated", "host"), default="isolated",
                   help="isolated: the contained agent reaches the grading API only; host: this machine's network "
                        "(for agents that call remote APIs; every local service is reachable, the evaluation "
                        "database included)")
    r.add_argument("--agent_env", action="append", default=[], metavar="VAR",
                   help="pass this variable of your environment to the agent (repeatable; e.g. an API key)")
    _add_eval_flags(r)
    r.set_defaults(func=run)


def _add_eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval_limit", type=int, default=None, metavar="N",
                   help="grade on the first N held-out tasks only (default: all)")
    p.add_argument("--max_evaluations", type=int, default=None, metavar="N",
                   help="gradings the agent may ask for (queued ones count; failed ones too); default: no limit")
    p.add_argument("--eval_timeout", type=float, default=7200.0, metavar="S",
                   help="seconds an evaluation may run; a longer one is stopped and fails (default: 7200)")
    p.add_argument("--db_connection_string", default=None,
                   help="MongoDB for the evaluations (default: $AGENTRL_DB or the embedded server; database "
                        "autorl-bench)")
    p.add_argument("--engine_args", default="", help="flags of the agentrl engine each evaluation starts, e.g. "
                                                     "'--device cuda --dtype bfloat16'")
    p.add_argument("--scenario", action="append", default=[], metavar="FILE.yaml",
                   help="a scenario file of your own (repeatable)")


def list_scenarios(args: argparse.Namespace) -> int:
    from agentrl.autorl_bench.scenarios import ScenarioError, ScenarioSet, count_lines, fingerprint

    try:
        scenarios = ScenarioSet(args.scenario)
        rows = [scenarios.get(i) for i in scenarios.ids()]
    except ScenarioError as error:
        print(f"agentrl bench list: error: {error}", file=sys.stderr)
        return 2
    print(f"{'id':<12} {'type':<12} {'metric':<13} {'train':>6} {'test':>5}  {'held-out hash':<16}  name")
    for s in rows:
        print(f"{s.id:<12} {s.type:<12} {s.metric:<13} {count_lines(s.train_data_path):>6} "
              f"{count_lines(s.test_data_path):>5}  {fingerprint(s.test_data_path):<16}  {s.name}")
    return 0


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from agentrl.autorl_bench.server import BenchServerConfig
    from agentrl.autorl_bench.server import serve as serve_bench

    urls = [u.strip() for u in (args.inference_urls or "").split(",") if u.strip()]
    try:
        config = BenchServerConfig(
            task=args.task, workspace=args.workspace, output_dir=args.output_dir, host=args.host, port=args.port,
            eval_limit=args.eval_limit, eval_timeout=args.eval_timeout, max_evaluations=args.max_evaluations,
            db_connection_string=args.db_connection_string, engine_args=args.engine_args, inference_urls=urls,
            env_server=args.env_server, scenario=args.scenario, state_dir=args.state_dir,
            unix_socket=args.unix_socket, admin_token_env=args.admin_token_env)
    except ValidationError as error:
        print(f"agentrl bench serve: error: {error}", file=sys.stderr)
        return 2
    return serve_bench(config)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from agentrl.autorl_bench.orchestrator import BenchRunError, RunOptions
    from agentrl.autorl_bench.orchestrator import run as run_bench
    from agentrl.autorl_bench.scenarios import ScenarioError

    try:
        options = RunOptions(agent=args.agent, task=args.task, base_model=args.base_model, timeout=args.timeout,
                             port=args.port, host=args.host, workspace_root=args.workspace_root,
                             results_dir=args.results_dir, agents_dir=args.agents_dir, eval_limit=args.eval_limit,
                             eval_timeout=args.eval_timeout, max_evaluations=args.max_evaluations,
                             db_connection_string=args.db_connection_string, engine_args=args.engine_args,
                             scenario=args.scenario, uncontained=args.uncontained,
                             agent_network=args.agent_network, agent_env=args.agent_env)
        return run_bench(options, say=lambda text: print(f"agentrl bench: {text}", flush=True))
    except (ValidationError, BenchRunError, ScenarioError) as error:
        print(f"agentrl bench run: error: {error}", file=sys.stderr)
        return 2
