"""`agentrl watch`: one live status line for a training run, read from its database.

Trajectories done and running with their rate, the recent mean reward, groups kept and dropped (and why), the
Records not trained per failure class, the sample queue, the trainer's step, loss and staleness, and the ETA. A
line is printed above it for every trainer step, and a warning as soon as most groups are dropped for zero reward
variance. On a terminal the line is live (rich); into a file or pipe it is printed every ``--log_every_s`` seconds
instead.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from agentrl.cli.options import add_db_option

if TYPE_CHECKING:  # the store (pymongo) is imported when a command runs, not for `agentrl --help`
    from agentrl.store.progress import Progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("watch", help="a live status line of a training run (trajectories, groups, steps, ETA)",
                            description=__doc__.split("\n\n")[1].replace("\n", " "))
    add_db_option(parser)
    parser.add_argument("--split", default="train", help="split to follow (default: train)")
    parser.add_argument("--until_pid", type=int, default=None, metavar="PID",
                        help="stop when this process (e.g. the trainer) has exited; without it, when the run is "
                             "finished or failed")
    parser.add_argument("--interval_s", type=float, default=1.0, help="refresh interval (default: 1 s)")
    parser.add_argument("--log_every_s", type=float, default=30.0,
                        help="when the output is not a terminal: print the line this often (default: 30 s)")
    parser.add_argument("--label", default="RL", help="what the line starts with (default: RL)")
    parser.set_defaults(func=run)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def status_line(progress: Progress, label: str, per_minute: float | None = None) -> str:
    """The one-line summary of a :class:`~agentrl.store.progress.Progress` (``per_minute``: trajectory rate)."""
    from agentrl.cli.progress_text import failure_line, reason_label

    parts = []
    total = f"/{progress.max_steps}" if progress.max_steps else ""
    trainer = f"{label} step {progress.step}{total}"
    metric = progress.last_metric
    if "loss" in metric:
        trainer += f" loss {metric['loss']:.4g}"
    if "staleness_mean" in metric:
        trainer += f" stale {metric['staleness_mean']:.1f}"
    parts.append(trainer)
    rate = "" if per_minute is None else f", {per_minute:.1f}/min"
    parts.append(f"trajectories {progress.trajectories} done, {progress.running} running{rate}")
    if progress.recent_reward is not None:
        parts.append(f"reward {progress.recent_reward:.2f}")
    dropped = sum(progress.groups_dropped.values())
    groups = f"groups {progress.groups_kept} kept, {dropped} dropped"
    if dropped:
        groups += " (" + ", ".join(f"{n} {reason_label(reason)}"
                                   for reason, n in progress.groups_dropped.most_common()) + ")"
    parts.append(groups)
    if progress.failures:
        parts.append(f"not trained {sum(progress.failures.values())} ({failure_line(progress.failures)})")
    queue = f"queue {progress.samples_queued}"
    if progress.samples_skipped:
        queue += f", {progress.samples_skipped} skipped stale"
    parts.append(queue)
    if progress.eta_s is not None:
        parts.append(f"ETA {_duration(progress.eta_s)}")
    elif progress.time_limit_s:
        parts.append(f"time limit {_duration(progress.time_limit_s)}")
    return " | ".join(parts)


STEP_FIELDS = (("samples", "{:.0f} samples"), ("loss", "loss {:.4g}"), ("reward_mean", "reward {:.3f}"),
               ("staleness_mean", "staleness {:.2f}"), ("logprob_mismatch_mean", "lp-mismatch {:.1e}"),
               ("tokens_per_s", "{:.0f} tok/s"))
"""The metrics of a step line, in order: ``(Metric value name, format)``."""


def step_line(progress: Progress, label: str) -> str:
    """The permanent line printed when a trainer step completes."""
    metric, total = progress.last_metric, f"/{progress.max_steps}" if progress.max_steps else ""
    parts = [f"{label} step {progress.step}{total} trained"]
    parts += [template.format(metric[name]) for name, template in STEP_FIELDS if name in metric]
    if progress.step_seconds is not None:
        parts.append(f"{progress.step_seconds:.0f} s/step")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    from collections import deque

    from pymongo.errors import PyMongoError
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from agentrl.log import redact
    from agentrl.store import database_name, resolve_connection_string, sync_client
    from agentrl.store.progress import read_progress

    uri = resolve_connection_string(args.db_connection_string)
    client = sync_client(uri, serverSelectionTimeoutMS=5000)
    db = client[database_name(uri)]
    console = Console()
    interactive = console.is_terminal
    last_step, warned, last_log = None, False, 0.0
    done_at: deque[tuple[float, int]] = deque()  # (time, trajectories done) over the last minute: the rate

    def done(progress) -> bool:
        if args.until_pid is not None:
            return not _alive(args.until_pid)
        return progress is not None and progress.run_status in ("finished", "failed")

    live = Live(Text(""), console=console, refresh_per_second=4, transient=True) if interactive else None
    progress = None
    try:
        if live is not None:
            live.start()
        while True:
            try:
                progress = read_progress(db, args.split)
            except PyMongoError as error:  # the database may restart; keep watching
                line = f"database unreachable ({redact(str(error))[:80]}); retrying"
            else:
                if last_step is not None and progress.step > last_step:
                    console.print(step_line(progress, args.label), soft_wrap=True)
                last_step = progress.step
                warning = progress.zero_variance_warning()
                if warning and not warned:
                    warned = True
                    console.print(Text(f"warning: {warning}", style="bold yellow"), soft_wrap=True)
                now = time.monotonic()
                done_at.append((now, progress.trajectories))
                while now - done_at[0][0] > 60:
                    done_at.popleft()
                span = now - done_at[0][0]
                rate = (progress.trajectories - done_at[0][1]) * 60 / span if span >= 10 else None
                line = status_line(progress, args.label, rate)
            if live is not None:
                live.update(Text(line, overflow="ellipsis", no_wrap=True))
            elif time.monotonic() - last_log >= args.log_every_s:
                print(line, flush=True)
                last_log = time.monotonic()
            if done(progress):
                break
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        return 130
    finally:
        if live is not None:
            live.stop()
        client.close()
    if progress is not None:
        print(status_line(progress, args.label), file=sys.stdout, flush=True)
    return 0
