"""`agentrl status`: one screen that tells where a run stands."""

from __future__ import annotations

import argparse
from typing import Any

from agentrl.cli.options import add_db_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("status", help="counts per collection and state, leases, services, policy version")
    add_db_option(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from agentrl.log import redact
    from agentrl.store import database_name, resolve_connection_string, sync_client
    from agentrl.store.summary import run_summary

    uri = resolve_connection_string(args.db_connection_string)
    client = sync_client(uri, serverSelectionTimeoutMS=5000)
    try:
        summary = run_summary(client[database_name(uri)])
    finally:
        client.close()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary, redact(uri))
    return 0


def render(summary: dict[str, Any], where: str) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    from agentrl.cli.progress_text import failure_line

    console = Console(width=None if sys.stdout.isatty() else 200)  # no wrapping when piped into a file or tool
    run = summary["run"]
    head = f"[bold]{summary['database']}[/bold] at {where}"
    if run:
        head += f" — run {run['name']} ({run['status']}), policy version {run['policy_version']}"
    else:
        head += " — no trainer has started this run yet (policy version 0)"
    console.print(head)
    counts = Table(title="documents by state", show_header=True)
    counts.add_column("collection")
    counts.add_column("states")
    counts.add_column("total", justify="right")
    for name, states in summary["counts"].items():
        shown = ", ".join(f"{state} {n}" for state, n in states.items() if n) or "-"
        counts.add_row(name, shown, str(sum(states.values())))
    console.print(counts)
    leases = summary["leases"]
    console.print(f"sample leases: {leases['live']} live, {leases['expired']} expired (reclaimable); "
                  f"group stages pending: {summary['pending_group_stages']}; "
                  f"records finished in the last minute: {summary['recent_records_per_min']}")
    if summary["services"]:
        services = Table(title="inference services")
        for column in ("service", "kind", "status", "heartbeat", "weights", "running", "total", "policy probe"):
            services.add_column(column)
        for s in summary["services"]:
            probe = s["policy_probe"]
            checked = "-" if probe is None else (f"v{probe['version']} " + (
                f"ok ({probe['mean_abs_diff']:.2g})" if probe["ok"] else f"FAILED: {probe['error']}"))
            services.add_row(s["id"], s["kind"], s["state"], f"{s['heartbeat_age_s']}s ago", str(s["weight_version"]),
                             str(s["running_requests"]), str(s["total_requests"]), checked)
        console.print(services)
    else:
        console.print("inference services: none registered")
    if summary["failures"]:
        console.print("records not trained, by failure class: " + failure_line(summary["failures"]))
    if summary["reward_by_version"]:
        shown = ", ".join(f"v{r['policy_version']} {r['mean_score']:.3f} ({r['records']})"
                          for r in summary["reward_by_version"])
        console.print(f"mean score by policy version (trajectories): {shown}")
    if summary["last_metric"]:
        values = summary["last_metric"]["values"]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in list(values.items())[:8])
        console.print(f"last trainer step {summary['last_metric']['step']}: {shown}")
