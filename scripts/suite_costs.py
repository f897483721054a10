"""What each test costs the machine: a pytest plugin for issue #48's suite time.

    PYTHONPATH=scripts python3 -m pytest -p suite_costs --costs-out costs.json tests/ray

Per test: its wall time, the CPU the whole machine spent meanwhile (``/proc/stat``: every
process, Ray's workers and daemons included, so run it with nothing else on the machine),
and the Ray worker processes that appeared during it, by the name Ray gives them
(``ray::MapActor``: a pool actor, ``ray::…SplitCoordinator…``, ``ray::read_stage_task``...;
sampled every 0.2 s, idle workers left out). The suite is CPU-bound on 2 cores and most of
its CPU is process starts (each ``import torch`` is ~2 CPU-s here), so these say which tests
to make cheaper. Writes the rows as JSON (``--costs-out``) and prints the costliest tests and
files at the end. Use it without ``-n`` (xdist): the machine's CPU is not per worker.
"""
from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_SAMPLE_S = 0.2


def _busy_core_s() -> float:
    """CPU seconds the machine has spent, every core (user, system, ...; not idle or iowait)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / _TICK


def _ray_name(pid: str) -> str | None:
    """The name Ray gave a worker process (``ray::…``), None for any other process or an idle worker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    if not name.startswith("ray::") or name.startswith("ray::IDLE"):
        return None
    return name.split()[0]


class _Costs:
    def __init__(self) -> None:
        self.test: str | None = None
        self.rows: list[dict] = []
        self.new: dict = collections.defaultdict(collections.Counter)
        self._seen: set = set()
        threading.Thread(target=self._sample, name="suite-costs", daemon=True).start()

    def _sample(self) -> None:
        while True:
            for pid in os.listdir("/proc"):
                if pid.isdigit() and pid not in self._seen and (name := _ray_name(pid)) is not None:
                    self._seen.add(pid)
                    self.new[self.test][name] += 1
            time.sleep(_SAMPLE_S)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--costs-out", default="suite_costs.json", help="suite_costs: where the per-test rows go")


def pytest_configure(config: pytest.Config) -> None:
    config._suite_costs = _Costs()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    costs = item.config._suite_costs
    costs.test = item.nodeid
    t0, busy0 = time.monotonic(), _busy_core_s()
    yield
    costs.rows.append({"test": item.nodeid, "wall_s": time.monotonic() - t0, "core_s": _busy_core_s() - busy0})


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    costs = config._suite_costs
    time.sleep(2 * _SAMPLE_S)  # the last test's processes
    for row in costs.rows:
        row["ray_processes"] = dict(costs.new.get(row["test"], {}))
    with open(config.getoption("--costs-out"), "w") as f:
        json.dump(costs.rows, f, indent=1)
    files: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in costs.rows:
        acc = files[row["test"].split("::")[0]]
        acc[0] += row["wall_s"]
        acc[1] += row["core_s"]
        acc[2] += sum(row["ray_processes"].values())
    write = terminalreporter.write_line
    write(f"suite costs: {sum(r['wall_s'] for r in costs.rows):.0f} s, {sum(r['core_s'] for r in costs.rows):.0f} "
          f"core-s, {sum(a[2] for a in files.values())} Ray worker processes ({config.getoption('--costs-out')})")
    for path, (wall, core, procs) in sorted(files.items(), key=lambda kv: -kv[1][1])[:15]:
        write(f"  {core:7.1f} core-s {wall:7.1f} s {procs:4d} processes  {path}")
    for row in sorted(costs.rows, key=lambda r: -r["core_s"])[:10]:
        write(f"  {row['core_s']:7.1f} core-s {row['wall_s']:7.1f} s  {row['test']}")
