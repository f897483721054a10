"""Measurement harness shared by the benchmarks (see /work/shared/BENCHMARKING.md).

Composable pieces, Linux only (everything is read from ``/proc``; no psutil):

- :func:`machine_info` / :func:`command_line`: what to write next to every figure.
- :class:`ProcTree`: the processes to account for (a root's descendants plus the
  embedded Ray session's daemons and workers), each with a class: ``trainer``,
  ``workers``, ``raylet``, ``gcs``, ``ray_daemons``, ``other``.
- :func:`measure`: a context manager that samples peak PSS summed over the tree,
  CPU seconds per process class, the machine's CPU use outside the tree
  (``/proc/stat``) and, optionally, peak object-store bytes from Ray's own
  accounting; ``m.watch(...)`` times the first item of an iterator.
- :func:`interleave`: run contenders in turn (A B C A B C ...) for N rounds,
  re-running rounds that other processes disturbed (:func:`quiet`,
  :func:`wait_quiet`).
- :func:`paused`: the processes of the contenders not being measured are stopped
  meanwhile, as if the measured loader were alone on the machine.
- :func:`cpu_ms_per_item`, :func:`timed_calls`: a function's CPU cost alone, in this
  thread (the calibrations).
- :func:`summarize`, :func:`median`, :func:`markdown_table`, :func:`pyplot`,
  :func:`write_results`, :func:`publish`.

Example::

    with measure("sbloader", object_store=True) as m:
        for batch in m.watch(lambda: ds.iter_batches(64)):
            m.add_items(len(batch["y"]))
    m.result.as_dict()   # wall_s, first_item_s, peak_pss_bytes, cpu_s_by_class, ...
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def ray_worker_env() -> None:
    """Call before Ray starts: a local Ray on loopback only, and Ray's workers import this
    folder's modules (workload functions are pickled by reference, not by value)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    here = str(Path(__file__).resolve().parent)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + rest)
CLK_TCK = os.sysconf("SC_CLK_TCK")
CLASSES = ("trainer", "workers", "raylet", "gcs", "ray_daemons", "other")

# Ray processes that are not task/actor workers although their title starts "ray::".
_RAY_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
_RAY_DAEMON_SCRIPTS = ("dashboard/dashboard.py", "dashboard/agent.py", "log_monitor.py",
                       "autoscaler/_private/monitor.py", "runtime_env/agent/main.py",
                       "ray_process_reaper.py", "ray_client_server")


# ----- machine & command -------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _version(dist: str) -> Optional[str]:
    try:  # the installed distribution's version, without importing it
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """nproc, memory, CPU model, Python/library versions and the date (UTC)."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": round(_mem_total_bytes() / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("sbloader", "torch", "ray", "numpy", "pyarrow", "pillow", "simplejpeg")},
    }


def command_line() -> str:
    """The exact command line of this process (as a shell would take it)."""
    return shlex.join([Path(sys.executable).name] + sys.argv)


# ----- /proc readers ------------------------------------------------------

def _read_stat(pid: int) -> Optional[tuple[int, int]]:
    """(ppid, utime+stime ticks) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def reaped_children_ticks(pid: int) -> int:
    """CPU ticks (cutime+cstime) of the children ``pid`` has waited for; 0 if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0
    rest = raw[raw.rfind(b")") + 2:].split()
    return int(rest[13]) + int(rest[14])


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (0 if gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cmdline(pid: int) -> str:
    """The command line of a process ('' if gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat (busy = total - idle - iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - fields[3] - fields[4], total


def _ppid_map() -> dict[int, int]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _read_stat(int(name))
            if st is not None:
                out[int(name)] = st[0]
    return out


def descendants(roots: Iterable[int], ppids: Optional[Mapping[int, int]] = None) -> set[int]:
    """The roots and all their descendants that are alive now."""
    ppids = _ppid_map() if ppids is None else ppids
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    stack = [r for r in roots if r in ppids]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, ()))
    return seen


def ray_session_roots() -> list[int]:
    """Pids of the current Ray session's raylet and GCS (when this process runs a Ray).

    Ray's daemons and workers of an embedded Ray are descendants of the driver
    anyway; this also finds them when the driver joined a Ray started elsewhere
    on this machine.
    """
    try:
        import ray

        if not ray.is_initialized():
            return []
        node = ray._private.worker.global_worker.node
        own = [p.process.pid for k in ("raylet", "gcs_server") for p in node.all_processes.get(k, ())]
        if own:  # a Ray this process started
            return own
        session = os.path.basename(node.get_session_dir_path())
    except Exception:
        return []
    roots = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            cmd = cmdline(int(name))
            if session in cmd and ("/raylet/raylet" in cmd or "/gcs/gcs_server" in cmd):
                roots.append(int(name))
    return roots


def is_ray_process(pid: int) -> bool:
    """A Ray daemon or worker (by its command line)."""
    cmd = cmdline(pid)
    exe = cmd.split(" ", 1)[0]
    return (cmd.startswith("ray::") or exe.endswith(("/raylet/raylet", "/gcs/gcs_server"))
            or any(s in cmd for s in _RAY_DAEMON_SCRIPTS))


def classify(pid: int, trainer_pid: int) -> str:
    """The process class used for CPU and memory accounting."""
    if pid == trainer_pid:
        return "trainer"
    cmd = cmdline(pid)
    if cmd.startswith(_RAY_AGENT_TITLES):
        return "ray_daemons"
    if cmd.startswith("ray::"):
        return "workers"
    exe = cmd.split(" ", 1)[0]
    if exe.endswith("/raylet/raylet"):
        return "raylet"
    if exe.endswith("/gcs/gcs_server"):
        return "gcs"
    if any(s in cmd for s in _RAY_DAEMON_SCRIPTS):
        return "ray_daemons"
    if "multiprocessing.resource_tracker" in cmd or "multiprocessing.forkserver" in cmd:
        return "other"
    if "python" in os.path.basename(exe) or "multiprocessing" in cmd or "torch" in cmd:
        return "workers"  # multiprocessing.Pool / DataLoader workers (titles are the parent's)
    return "other"


# ----- the process tree ------------------------------------------------------

@dataclass
class ProcTree:
    """The processes one measurement accounts for.

    Args:
        root: the trainer (default: this process); its descendants are included.
        include_ray_session: also include the current Ray session's raylet/GCS trees.
        ray: count Ray's processes (daemons and workers) at all; False measures a
            contender that does not use Ray while an embedded Ray idles beside it
            (its CPU then shows as outside the tree).
        exclude: pids never counted (e.g. a sampler process).
    """

    root: int = field(default_factory=os.getpid)
    include_ray_session: bool = True
    ray: bool = True
    exclude: frozenset = frozenset()
    _classes: dict[int, str] = field(default_factory=dict, repr=False)
    _session_roots: Optional[list] = field(default=None, repr=False)

    def pids(self) -> set[int]:
        """Alive pids of the tree now."""
        if self._session_roots is None:
            self._session_roots = ray_session_roots() if self.include_ray_session and self.ray else []
        pids = descendants([self.root] + self._session_roots) - set(self.exclude)
        if not self.ray:
            pids = {p for p in pids if not is_ray_process(p)}
        return pids

    def cls(self, pid: int) -> str:
        """Class of ``pid`` (cached per pid; Ray renames a worker when it runs a task, so
        a pid first seen as ``ray::IDLE`` stays a worker)."""
        c = self._classes.get(pid)
        if c is None:
            c = self._classes[pid] = classify(pid, self.root)
        return c


def snapshot(tree: Optional[ProcTree] = None, keep: Optional[Callable[[int], bool]] = None) -> dict[str, Any]:
    """PSS and process count by class, now (e.g. an idle Ray).

    Args:
        tree: the processes (default: this process, its descendants, the Ray session).
        keep: only count pids for which this is true (e.g. ``is_ray_process``).
    """
    tree = tree or ProcTree()
    by_class: dict[str, dict[str, int]] = {}
    procs = []
    for pid in sorted(p for p in tree.pids() if keep is None or keep(p)):
        c, p = tree.cls(pid), pss_bytes(pid)
        d = by_class.setdefault(c, {"pss_bytes": 0, "processes": 0})
        d["pss_bytes"] += p
        d["processes"] += 1
        procs.append({"pid": pid, "class": c, "pss_mib": round(p / 2**20, 1), "cmd": cmdline(pid)[:90]})
    return {
        "pss_bytes": sum(d["pss_bytes"] for d in by_class.values()),
        "processes": sum(d["processes"] for d in by_class.values()),
        "by_class": by_class,
        "processes_detail": procs,
    }


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


class ObjectStoreSampler:
    """Peak object-store bytes from Ray's own accounting (the raylets' store stats).

    Args:
        address: the GCS address (default: the connected Ray's).
    """

    def __init__(self, address: Optional[str] = None) -> None:
        import ray
        from ray._private import internal_api

        self._api = internal_api
        self._state = internal_api.get_state_from_address(address or ray.get_runtime_context().gcs_address)
        self.peak_bytes = 0
        self.samples = 0

    def step(self) -> None:
        """Take one sample."""
        reply = self._api.get_memory_info_reply(self._state)
        used = int(reply.store_stats.object_store_bytes_used)
        self.peak_bytes = max(self.peak_bytes, used)
        self.samples += 1


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
    first_item_s: Optional[float] = None
    items: int = 0
    items_per_s: Optional[float] = None
    peak_pss_bytes: int = 0
    peak_pss_by_class: dict = field(default_factory=dict)
    processes_at_peak: int = 0
    max_processes: int = 0
    cpu_s_by_class: dict = field(default_factory=dict)
    cpu_s_tree: float = 0.0
    machine_cpu_frac: float = 0.0
    outside_cpu_frac: float = 0.0
    peak_object_store_bytes: Optional[int] = None
    sampler_cpu_s: float = 0.0
    samples: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return asdict(self)


class Measurement:
    """Live handle of :func:`measure`; ``result`` is complete after the block exits."""

    def __init__(self, label: str) -> None:
        self.result = Result(label)
        self._t0 = time.perf_counter()

    def add_items(self, n: int = 1) -> None:
        """Count ``n`` items (rows, images) towards ``items_per_s``."""
        self.result.items += n

    def mark_first(self, t_start: Optional[float] = None) -> None:
        """Record the first item now (seconds since ``t_start``, default the block's start)."""
        if self.result.first_item_s is None:
            self.result.first_item_s = time.perf_counter() - (self._t0 if t_start is None else t_start)

    def watch(self, iterable: Any) -> Iterator[Any]:
        """Iterate ``iterable`` (or call it first, if it is a zero-argument factory),
        recording the time from this call to the first item in ``first_item_s``.

        Pass a factory (``lambda: ds.iter_batches(64)``) when creating the iterator
        already starts work: its start-up then counts.
        """
        t0 = time.perf_counter()
        it = iter(iterable() if callable(iterable) else iterable)
        return self._watch(it, t0)

    def _watch(self, it: Iterator[Any], t0: float) -> Iterator[Any]:
        for item in it:
            self.mark_first(t0)
            yield item


@contextmanager
def measure(label: str, *, tree: Optional[ProcTree] = None, object_store: bool = False,
            interval_s: float = 0.25, store_interval_s: float = 0.25, pss: bool = True) -> Iterator[Measurement]:
    """Measure the enclosed block: wall time, peak PSS and CPU by class, machine load.

    Args:
        label: the contender's name.
        tree: the processes to account for (default: this process, its
            descendants and the Ray session's daemons).
        object_store: also sample Ray's object-store bytes (needs a connected Ray).
        interval_s: PSS/CPU sampling period.
        pss: read each process's PSS at every sample. Reading PSS costs milliseconds
            per Ray process (~15 ms of CPU for an 11-process Ray tree, against ~1.3 ms
            for the CPU ticks); ``False`` samples CPU ticks only, for throughput runs
            that PSS sampling would slow (``peak_pss_bytes`` is then 0).
        store_interval_s: object-store sampling period.

    Yields:
        A :class:`Measurement`; read ``m.result`` after the block.
    """
    tree = tree or ProcTree()
    ts = TreeSampler(tree, pss=pss)
    samplers = [_Sampler(ts.step, interval_s, "harness-tree")]
    store = None
    if object_store:
        store = ObjectStoreSampler()
        samplers.append(_Sampler(store.step, store_interval_s, "harness-store"))
    busy0, total0 = machine_busy_ticks()
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
        r.items_per_s = r.items / wall if r.items and wall > 0 else None
        r.peak_pss_bytes, r.peak_pss_by_class = ts.peak_pss, ts.peak_by_class
        r.processes_at_peak, r.max_processes, r.samples = ts.peak_processes, ts.max_processes, ts.samples
        r.sampler_cpu_s = round(sum(s.cpu_s for s in samplers), 3)
        r.cpu_s_by_class = ts.cpu_s_by_class()
        if tree.root == os.getpid():  # the samplers run in this process: not the workload's CPU
            r.cpu_s_by_class["trainer"] = round(max(0.0, r.cpu_s_by_class["trainer"] - r.sampler_cpu_s), 3)
        r.cpu_s_tree = round(sum(r.cpu_s_by_class.values()), 3)
        total_cpu_s = (total1 - total0) / CLK_TCK  # = wall x cpus, from the kernel's clock
        busy_s = (busy1 - busy0) / CLK_TCK
        if total_cpu_s > 0:
            r.machine_cpu_frac = round(busy_s / total_cpu_s, 4)
            r.outside_cpu_frac = round(max(0.0, busy_s - r.cpu_s_tree - r.sampler_cpu_s) / total_cpu_s, 4)
        if store is not None:
            r.peak_object_store_bytes = store.peak_bytes
        errors = [repr(s.error) for s in samplers if s.error is not None]
        if errors:
            r.extra["sampler_errors"] = errors


# ----- a function alone (calibration) --------------------------------------

def cpu_ms_per_item(fn: Callable[[Sequence[Any]], Any], items: Sequence[Any], batch: int, batches: int = 6, *,
                    warm: bool = True, outputs: Optional[list] = None) -> float:
    """Thread CPU ms per item of ``fn`` alone, called on ``batches`` chunks of ``batch`` items.

    The chunks are the ones after the first chunk of ``items``; ``fn`` is called on that
    first one beforehand to warm it up (imports, page cache) unless ``warm=False``.

    Args:
        outputs: a list that receives what ``fn`` returned for each timed chunk (else
            each is dropped at once).
    """
    chunks = [items[s:s + batch] for s in range(0, min(len(items), (batches + 1) * batch), batch)]
    if warm:
        fn(chunks[0])
    n = sum(len(c) for c in chunks[1:])
    t = time.thread_time()
    if outputs is None:
        for c in chunks[1:]:
            fn(c)
    else:
        outputs.extend(fn(c) for c in chunks[1:])
    return (time.thread_time() - t) * 1e3 / n


def timed_calls(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(thread CPU s, wall s) per call of ``fn()`` over ``reps`` calls, after one call to warm up."""
    fn()
    c, w = time.thread_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.thread_time() - c) / reps, (time.perf_counter() - w) / reps


# ----- rounds & summaries ------------------------------------------------

def interleave(contenders: Mapping[str, Callable[[], Any]], rounds: int, *,
               accept: Optional[Callable[[Any], bool]] = None, max_retries: int = 2,
               before_round: Optional[Callable[[], Any]] = None,
               on_result: Optional[Callable[[str, int, Any], None]] = None) -> dict[str, list[Any]]:
    """Run every contender once per round, in turn (A B C A B C ...).

    Args:
        contenders: name -> zero-argument callable returning that run's result.
        rounds: rounds (BENCHMARKING.md asks for at least 3).
        accept: a result check (e.g. :func:`quiet`); a round with a rejected result
            is run again, up to ``max_retries`` times, and the attempt with the
            most accepted results is kept (the later one on a tie).
        max_retries: extra attempts per round.
        before_round: called before each round and retry (e.g. :func:`wait_quiet`).
        on_result: called with (name, round, result) after each run (progress).

    Returns:
        name -> list of results, one per round. A :class:`Result` records its
        round's attempts in ``extra["round_attempts"]``.
    """
    out: dict[str, list[Any]] = {name: [] for name in contenders}
    for r in range(rounds):
        best: Optional[dict] = None
        best_ok = -1
        for attempt in range(max_retries + 1):
            if before_round is not None:
                before_round()
            got = {}
            for name, fn in contenders.items():
                got[name] = fn()
                if on_result is not None:
                    on_result(name, r, got[name])
            ok = len(got) if accept is None else sum(bool(accept(v)) for v in got.values())
            if ok >= best_ok:
                best, best_ok = got, ok
            if ok == len(got):
                break
        for name, v in best.items():
            if isinstance(v, Result):
                v.extra["round_attempts"] = attempt + 1
            out[name].append(v)
    return out


def wait_quiet(max_busy_frac: float = 0.05, window_s: float = 1.0, timeout_s: float = 20.0) -> float:
    """Wait (at most ``timeout_s``) until the machine's CPUs were busy at most
    ``max_busy_frac`` over a ``window_s`` window; returns the last window's busy fraction."""
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = machine_busy_ticks()
        time.sleep(window_s)
        b1, t1 = machine_busy_ticks()
        frac = (b1 - b0) / max(1, t1 - t0)
        if frac <= max_busy_frac or time.monotonic() >= deadline:
            return frac


@contextmanager
def paused(pids: Iterable[int]) -> Iterator[int]:
    """Stop the processes ``pids`` (``SIGSTOP``) for the block, then continue them;
    yields how many were stopped.

    A benchmark that keeps every contender alive for interleaved rounds (idle Rays,
    persistent workers) pauses the contenders it is not measuring: an idle Ray's
    timers and polls wake a dozen threads all the time, and even at idle priority
    (``SCHED_IDLE``) they took ~1% of a busy 2-core machine from the measured
    contender, as if it were not alone (side by side: alone-by-pausing +2.7%, at idle
    priority +1%, over leaving them as they are). Stops last one run (seconds); Ray's
    health checks (5 misses of 3 s each) and connections ride them out. Processes that
    are gone by the end are skipped.

    Never pause processes of the caller's own process group: if the group becomes
    orphaned while one is stopped (the shell that started it exits), the kernel sends
    the whole group SIGHUP. Put what you pause in a session of its own (``setsid``).
    """
    stopped = []
    for pid in sorted(set(pids)):
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except OSError:
            continue
    try:
        yield len(stopped)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass


def quiet(result: Result, max_outside_frac: float = 0.05) -> bool:
    """True when processes outside the measured tree took at most ``max_outside_frac`` of the CPU."""
    return result.outside_cpu_frac <= max_outside_frac


def median(values: Iterable[Optional[float]]) -> Optional[float]:
    """The median of the numbers (None values are left out); None if none are left."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize(values: Sequence[Optional[float]]) -> dict[str, Any]:
    """Median, min, max and n of the numbers (None values are left out)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_range(s: Mapping[str, Any], fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    """``median (min–max)`` of a :func:`summarize` dict."""
    if not s or s.get("median") is None:
        return "–"
    f = lambda v: fmt.format(v * scale)  # noqa: E731
    return f"{f(s['median'])} ({f(s['min'])}–{f(s['max'])})"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """A Markdown table of ``rows`` (dicts) with the given columns, in order (default: the
    first row's keys)."""
    columns = list(rows[0]) if columns is None else columns
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def mib(nbytes: Optional[float]) -> str:
    """Bytes as MiB text."""
    return "–" if nbytes is None else f"{nbytes / 2**20:.0f}"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; None without matplotlib
    (the benchmarks then write no figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, save (110 dpi) and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(name: str, payload: Mapping[str, Any], markdown: str, *,
                  title: Optional[str] = None, results_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``<name>.json`` (payload + command + machine) and ``<name>.md``.

    The Markdown gets a header with the command, machine, versions and date.

    Returns:
        The two paths.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    machine = payload.get("machine") or machine_info()
    command = payload.get("command") or command_line()
    full = {"command": command, "machine": machine, **{k: v for k, v in payload.items() if k not in ("command", "machine")}}
    jpath = results_dir / f"{name}.json"
    jpath.write_text(json.dumps(full, indent=2, default=str) + "\n")
    v = machine["versions"]
    header = [
        f"# {title or name}",
        "",
        f"- command: `{command}`",
        f"- date: {machine['date']}",
        f"- machine: {machine['nproc']} cores ({machine['cpu_model']}), {machine['mem_total_gib']} GiB, "
        f"kernel {machine['kernel']}",
        "- versions: python " + machine["python"] + ", "
        + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- raw data: `{jpath.name}`",
        "",
    ]
    mpath = results_dir / f"{name}.md"
    mpath.write_text("\n".join(header) + markdown.rstrip() + "\n")
    return jpath, mpath


def publish(name: str, payload: Mapping[str, Any], markdown: str, *, title: str, png: Optional[Path] = None,
            alt: Optional[str] = None, show: bool = True, note: str = "") -> tuple[Path, Path]:
    """:func:`write_results`, then say so: the Markdown (unless ``show=False``) and a
    ``wrote <json> and <md>[ and <png>]<note>`` line.

    Args:
        png: a figure already saved next to the results: shown at the end of the
            Markdown (``![alt](name.png)``, ``alt`` default ``name``) and named in the line.

    Returns:
        The JSON and Markdown paths.
    """
    if png is not None:
        markdown += f"\n\n![{alt or name}]({png.name})\n"
    jpath, mpath = write_results(name, payload, markdown, title=title)
    if show:
        print(mpath.read_text())
    print(f"wrote {jpath} and {mpath}" + (f" and {png}" if png else "") + note, flush=True)
    return jpath, mpath
