"""Measure one run: wall time, peak PSS of the process tree and CPU seconds per process
class (sampled from /proc in a thread), the machine's other load::

    with measure("sbloader") as m:
        run_epoch()
    m.result.as_dict()   # wall_s, peak_pss_bytes, cpu_s_by_class, outside_cpu_frac, ...
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional

from .load import cpu_account, is_quiet, loadavg, machine_busy_ticks
from .procs import CLASSES, CLK_TCK, ProcTree, _read_stat, pss_bytes, reaped_children_ticks


# ----- samplers ------------------------------------------------------------

class _Sampler(threading.Thread):
    """Calls ``step`` every ``interval`` seconds until stopped (and once more at the end)."""

    def __init__(self, step: Callable[[], None], interval: float, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._step, self._interval = step, interval
        self._stop_event = threading.Event()
        self.cpu_s = 0.0  # this thread's own CPU time: the cost of measuring
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        t = time.thread_time()
        try:
            while True:
                self._step()
                if self._stop_event.wait(self._interval):
                    break
            self._step()
        except BaseException as e:  # reported, never raised into the benchmark
            self.error = e
        self.cpu_s = time.thread_time() - t

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


class TreeSampler:
    """Samples PSS (sum and per class; unless ``pss=False``) and CPU ticks per pid of a :class:`ProcTree`."""

    def __init__(self, tree: ProcTree, pss: bool = True) -> None:
        self.tree = tree
        self.pss = pss
        self.ppids: dict[int, int] = {}
        self.alive: set[int] = set()  # the pids of the last sample
        self.reaped_ticks = [0, 0]  # the root's waited-for children's ticks: first and last sample
        self.start_ticks: dict[int, int] = {}
        self.last_ticks: dict[int, int] = {}
        self.peak_pss = 0
        self.peak_by_class: dict[str, int] = {}
        self.peak_processes = 0
        self.max_processes = 0
        self.samples = 0
        self._first = True

    def step(self) -> None:
        """Take one sample."""
        pids = self.tree.pids()
        total, by_class = 0, {}
        reaped = reaped_children_ticks(self.tree.root)
        if self._first:
            self.reaped_ticks[0] = reaped
        self.reaped_ticks[1] = reaped
        self.alive = set()
        for pid in pids:
            st = _read_stat(pid)
            if st is None:
                continue
            self.alive.add(pid)
            self.ppids[pid] = st[0]
            if self._first:
                self.start_ticks[pid] = st[1]
            self.last_ticks[pid] = st[1]
            p = pss_bytes(pid) if self.pss else 0
            total += p
            c = self.tree.cls(pid)
            by_class[c] = by_class.get(c, 0) + p
        self._first = False
        self.samples += 1
        self.max_processes = max(self.max_processes, len(pids))
        if total > self.peak_pss:
            self.peak_pss, self.peak_by_class, self.peak_processes = total, by_class, len(pids)

    def cpu_s_by_class(self) -> dict[str, float]:
        """CPU seconds used in the window per class (processes born in it count in full).

        A child of the root that exited during the window (torch's non-persistent
        workers) ran on after its last sample; the root's waited-for children's
        ticks (``cutime``) hold its whole CPU, so that tail (and children born and
        gone between two samples) is added to the class of those children.
        """
        out = {c: 0.0 for c in CLASSES}
        for pid, last in self.last_ticks.items():
            c = self.tree.cls(pid)
            out[c] = out.get(c, 0.0) + (last - self.start_ticks.get(pid, 0)) / CLK_TCK
        gone = [p for p in self.last_ticks if p not in self.alive and self.ppids.get(p) == self.tree.root]
        tail = self.reaped_ticks[1] - self.reaped_ticks[0] - sum(self.last_ticks[p] for p in gone)
        if tail > 0:
            c = self.tree.cls(gone[0]) if gone else "workers"
            out[c] = out.get(c, 0.0) + tail / CLK_TCK
        return {c: round(v, 3) for c, v in out.items()}


# ----- measure -------------------------------------------------------------

@dataclass
class Result:
    """What one measured run produced."""

    label: str
    wall_s: float = 0.0
    peak_pss_bytes: int = 0
    peak_pss_by_class: dict = field(default_factory=dict)
    processes_at_peak: int = 0
    max_processes: int = 0
    cpu_s_by_class: dict = field(default_factory=dict)
    cpu_s_tree: float = 0.0
    machine_cpu_frac: float = 0.0
    outside_cpu_frac: float = 0.0
    sampler_cpu_s: float = 0.0
    samples: int = 0
    loadavg: list = field(default_factory=list)
    quiet: bool = False
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


class Measurement:
    """Live handle of :func:`measure`; ``result`` is complete after the block exits."""

    def __init__(self, label: str) -> None:
        self.result = Result(label)
        self._t0 = time.perf_counter()


@contextmanager
def measure(label: str, *, tree: Optional[ProcTree] = None, interval_s: float = 0.25,
            pss: bool = True) -> Iterator[Measurement]:
    """Measure the enclosed block: wall time, peak PSS and CPU by class, machine load.

    Args:
        label: the contender's name.
        tree: the processes to account for (default: this process, its
            descendants and the Ray session's daemons).
        interval_s: PSS/CPU sampling period.
        pss: read each process's PSS at every sample. Reading PSS costs milliseconds
            per Ray process (~15 ms of CPU for an 11-process Ray tree, against ~1.3 ms
            for the CPU ticks); ``False`` samples CPU ticks only, for throughput runs
            that PSS sampling would slow (``peak_pss_bytes`` is then 0).

    Yields:
        A :class:`Measurement`; read ``m.result`` after the block.
    """
    tree = tree or ProcTree()
    ts = TreeSampler(tree, pss=pss)
    samplers = [_Sampler(ts.step, interval_s, "harness-tree")]
    busy0, total0 = machine_busy_ticks()
    avg0 = loadavg()
    m = Measurement(label)
    for s in samplers:
        s.start()
    try:
        yield m
    finally:
        wall = time.perf_counter() - m._t0
        for s in samplers:
            s.stop()
        busy1, total1 = machine_busy_ticks()
        r = m.result
        r.wall_s = wall
        r.peak_pss_bytes, r.peak_pss_by_class = ts.peak_pss, ts.peak_by_class
        r.processes_at_peak, r.max_processes, r.samples = ts.peak_processes, ts.max_processes, ts.samples
        r.sampler_cpu_s = round(sum(s.cpu_s for s in samplers), 3)
        r.cpu_s_by_class = ts.cpu_s_by_class()
        if tree.root == os.getpid():  # the samplers run in this process: not the workload's CPU
            r.cpu_s_by_class["trainer"] = round(max(0.0, r.cpu_s_by_class["trainer"] - r.sampler_cpu_s), 3)
        r.cpu_s_tree = round(sum(r.cpu_s_by_class.values()), 3)
        ours = r.cpu_s_tree + r.sampler_cpu_s
        acc = cpu_account(busy1 - busy0, total1 - total0, ours, CLK_TCK)
        r.machine_cpu_frac, r.outside_cpu_frac = acc["machine_cpu_frac"], acc["outside_cpu_frac"]
        r.loadavg = [list(avg0), list(loadavg())]
        r.quiet = is_quiet(r.outside_cpu_frac)
        errors = [repr(s.error) for s in samplers if s.error is not None]
        if errors:
            r.extra["sampler_errors"] = errors


