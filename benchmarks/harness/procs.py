"""Which processes a measurement accounts for, and what /proc says about them (Linux only;
no psutil): CPU ticks, PSS, command lines, the process tree, Ray's own processes."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

CLK_TCK = os.sysconf("SC_CLK_TCK")
CLASSES = ("trainer", "workers", "raylet", "gcs", "ray_daemons", "other")

# Ray processes that are not task/actor workers although their title starts "ray::".
_RAY_AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
_RAY_DAEMON_SCRIPTS = ("dashboard/dashboard.py", "dashboard/agent.py", "log_monitor.py",
                       "autoscaler/_private/monitor.py", "runtime_env/agent/main.py",
                       "ray_process_reaper.py", "ray_client_server")


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


def _running(pid: int) -> bool:
    """Alive and not a zombie (exited, waiting for its parent to reap it)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return raw[raw.rfind(b")") + 2:][:1] not in (b"Z", b"X")


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
        also: more roots, asked at every sample (a ``ray start`` cluster's daemons, which
            are no descendants of the driver: else counted as others' load).
    """

    root: int = field(default_factory=os.getpid)
    include_ray_session: bool = True
    ray: bool = True
    exclude: frozenset = frozenset()
    also: Optional[Callable[[], Iterable[int]]] = None
    _classes: dict[int, str] = field(default_factory=dict, repr=False)
    _session_roots: Optional[list] = field(default=None, repr=False)

    def pids(self) -> set[int]:
        """Alive pids of the tree now."""
        if self._session_roots is None:
            self._session_roots = ray_session_roots() if self.include_ray_session and self.ray else []
        extra = list(self.also()) if self.also is not None else []
        pids = descendants([self.root] + self._session_roots + extra) - set(self.exclude)
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


# ----- what a finished scenario left behind ------------------------------------

def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux ``prctl``): a process whose
    parent exits is re-parented here, not to init, so :func:`left_behind` still finds what a
    child started and left running (an embedded Ray's raylet, GCS, agents and ``ray::``
    workers, whose titles hide their environment; a ``ray start`` cluster's daemons; a
    server). True if the kernel took it. Call :func:`reap` now and then after it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap(keep: Iterable[int] = ()) -> int:
    """Reap this process's exited children (the orphans it adopted), except those in ``keep``
    (a child whose ``Popen`` waits for it); how many. Stops at the first exited one in ``keep``."""
    n, keep = 0, set(keep)
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # look, do not reap
        except ChildProcessError:
            return n
        if info is None or info.si_pid in keep:
            return n
        os.waitpid(info.si_pid, 0)
        n += 1


def left_behind(root: Optional[int] = None) -> dict[int, str]:
    """The running descendants of ``root`` (default: this process; not ``root`` itself), with
    their command lines; zombies are not running."""
    root = os.getpid() if root is None else root
    return {pid: cmdline(pid) for pid in sorted(descendants([root]) - {root}) if _running(pid)}


def wait_gone(find: Callable[[], Mapping[int, str]] = left_behind, timeout_s: float = 60.0,
              poll_s: float = 0.2) -> dict[int, str]:
    """Ask ``find`` every ``poll_s`` until it finds nothing or ``timeout_s`` passed; what it
    found last (``{}``: all gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = dict(find())
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)
