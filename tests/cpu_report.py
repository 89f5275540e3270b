"""Opt-in pytest plugin: the CPU time each test module costs, its own and that of the processes it started.

    ./scripts/test.sh --cpu-report -n 4 --dist loadgroup --also-secantus    # the whole suite as CI runs it

Around every test it reads ``getrusage`` for the process (``self``) and for its reaped children (``children``:
the engines, trainers and samplers a test starts and waits for, and their own children), and sums both per module;
under xdist each worker sends its sums to the controller, which prints one table at the end, largest first. The
suite is CPU-bound on 2 cores, so this says where its time goes. Caveats: a child is counted when it is reaped, so
a session fixture's server counts at the end of the session (not listed), and a process killed without being
waited for is counted by whichever later test reaps it.
"""

from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

Sums = dict[str, list[float]]
"""module -> [self CPU s, children CPU s, wall s, tests]"""
_sums: Sums = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
_from_workers: list[Sums] = []


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    sums = _sums[item.module.__name__ if item.module is not None else item.nodeid.split("::")[0]]
    sums[0] += _cpu(resource.RUSAGE_SELF) - own
    sums[1] += _cpu(resource.RUSAGE_CHILDREN) - children
    sums[2] += time.monotonic() - wall
    sums[3] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the sums to the controller
        session.config.workeroutput["cpu_report"] = json.dumps(_sums)


def pytest_testnodedown(node, error) -> None:  # xdist's hook, on the controller
    if "cpu_report" in getattr(node, "workeroutput", {}):
        _from_workers.append(json.loads(node.workeroutput["cpu_report"]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    total: Sums = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for sums in [_sums, *_from_workers]:
        for module, values in sums.items():
            total[module] = [a + b for a, b in zip(total[module], values)]
    rows = sorted(total.items(), key=lambda item: -(item[1][0] + item[1][1]))
    cpu = sum(own + children for own, children, _, _ in total.values())
    terminalreporter.write_sep("=", f"CPU by test module: {cpu:.0f} CPU-seconds in all")
    terminalreporter.write_line(f"{'module':48s} {'CPU s':>8s} {'own':>7s} {'children':>9s} {'wall s':>7s} "
                                f"{'tests':>5s} {'share':>6s}")
    for module, (own, children, wall, tests) in rows:
        terminalreporter.write_line(f"{module:48s} {own + children:8.1f} {own:7.1f} {children:9.1f} {wall:7.1f} "
                                    f"{int(tests):5d} {(own + children) / max(cpu, 1e-9):6.1%}")
