"""The embedded Ray's start, cut short when the process exits before it is done.

A short script may end on the local workers while Ray still starts in the background
(:mod:`sbloader.runtime.background`). A thread left inside Ray's start when the interpreter
finalizes aborts the process ("FATAL: exception not rethrown": the daemon thread is ended
inside C++ when it takes the GIL back), so the exit once waited for the whole start (seconds)
and then for Ray's shutdown. Now the start runs under :func:`cancellable`: once :func:`cut`
is asked (the exit, :func:`sbloader.runtime.background.settle`), the start's next Python call
raises :class:`StartCancelled`, the start unwinds in Python (after at most the one C++ call it
is inside), and :func:`sweep` kills the processes it had spawned and resets Ray's state.

The cut is a trace function (``sys.settrace``, 'call' events only) on the thread that runs
``ray.init``, set for the start alone. It never raises inside an import (a module half made),
a ``__del__``, an ``__exit__`` or the standard library (``logging`` lets its lock go with a call
that a raise would skip): it waits for the next call outside them. Nothing starts Ray
once the cut was asked (:func:`asked`). Only a process's own Ray is cut: the ranks of a torchrun
job wait for local rank 0's Ray, which therefore starts (and stops) as before.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Optional, TypeVar

from sbloader.runtime import reaper

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"asked": False, "raised": False, "swept": False}


class StartCancelled(BaseException):
    """Ray's start was cut short: the process exits (a ``BaseException``, as ``SystemExit``: no
    ``except Exception`` of Ray's start catches it on its way out)."""


def asked() -> bool:
    """Whether the process exits (:func:`cut` was asked): nothing may start Ray now."""
    return _STATE["asked"]


def cut() -> None:
    """The process exits: a start of Ray under way (:func:`cancellable`) raises :class:`StartCancelled` at
    its next Python call outside an import, and one about to begin raises at once."""
    _hush_unraisable()
    with _LOCK:
        _STATE["asked"] = True


def cancellable(fn: Callable[[], _T]) -> _T:
    """Run ``fn()`` (``ray.init``) on this thread, cut short by :func:`cut`. Where a tracer already runs on
    this thread (a debugger, coverage) ``fn`` runs under it, not cancellable: the exit then waits for it."""
    with _LOCK:
        if _STATE["asked"]:
            raise StartCancelled("sbloader: the process exits: Ray's start was not begun")
    if sys.gettrace() is not None:
        return fn()
    _STATE["ident"] = threading.get_ident()
    sys.settrace(_trace)
    try:
        return _inside(fn)
    finally:
        sys.settrace(None)
        _STATE["ident"] = None


def _inside(fn: Callable[[], _T]) -> _T:
    """The frame below which :func:`_trace` may raise (its code marks the bottom of the cut's search)."""
    return fn()


def _trace(frame: Any, event: str, arg: Any) -> None:
    """'call' events of the thread that starts Ray: raise once the cut was asked, at a call it is safe to
    unwind from. Returns None: no line or return events (the start runs at nearly full speed)."""
    if _STATE["asked"] and not _STATE["raised"] and _unwindable(frame):
        _STATE["raised"] = True
        _STATE["at"] = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"  # for a debugger
        raise StartCancelled("sbloader: the process exits before Ray's start was done")
    return None


_INSIDE_CODE = _inside.__code__
_HELD_NAMES = ("<module>", "__del__", "__exit__", "__aexit__")


def _stdlib_dirs() -> tuple:
    """The standard library's folders, and the site-packages folders inside them (those are not it)."""
    import sysconfig

    paths = sysconfig.get_paths()
    std = tuple({os.path.join(paths[k], "") for k in ("stdlib", "platstdlib") if paths.get(k)})
    site = tuple({os.path.join(paths[k], "") for k in ("purelib", "platlib") if paths.get(k)})
    return std, site


_STDLIB, _SITE = _stdlib_dirs()


def _in_stdlib(filename: str) -> bool:
    """Whether code of ``filename`` is the standard library's (frozen modules included)."""
    return filename.startswith("<frozen ") or (filename.startswith(_STDLIB) and not filename.startswith(_SITE))


def _unwindable(frame: Any) -> bool:
    """Whether no frame between ``frame`` and :func:`_inside` is an import (a module's body, importlib),
    a finalizer, a context's exit or the standard library's code: an exception there would leave a module
    half made or a lock held (``logging`` lets its lock go with a call, often outside a ``finally``)."""
    f = frame
    while f is not None and f.f_code is not _INSIDE_CODE:
        code = f.f_code
        if code.co_name in _HELD_NAMES or _in_stdlib(code.co_filename):
            return False
        f = f.f_back
    return f is not None


def was_cut(error: Optional[BaseException]) -> bool:
    """Whether ``error`` (the background start's) is the cut's."""
    return isinstance(error, StartCancelled)


def _hush_unraisable() -> None:
    """A :class:`StartCancelled` that reaches no caller (raised in a callback that C code ran on the start's
    thread, which swallows what it raises) is not printed, and the cut is set again: the start's next call
    raises it anew (Python removed the trace when it raised)."""
    hook = sys.unraisablehook
    if getattr(hook, "_sbloader_hushed", False):
        return

    def hushed(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, StartCancelled):
            hook(unraisable)
        elif _STATE.get("ident") == threading.get_ident():
            _STATE["raised"] = False
            sys.settrace(_trace)

    hushed._sbloader_hushed = True  # type: ignore[attr-defined]
    sys.unraisablehook = hushed


def _session_pattern() -> "re.Pattern[bytes]":
    """A Ray process started by this process names its session: ``session_<date>_<time>_<us>_<pid>``."""
    return re.compile(rb"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_%d(?![0-9])" % os.getpid())


def session_children() -> list[int]:
    """This process's children that belong to a Ray session it started (GCS, raylet, dashboard, log
    monitor, monitor): their command lines name the session, whose name ends with this pid."""
    pattern = _session_pattern()
    me = os.getpid()
    out = []
    for pid in reaper.children(me):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if pattern.search(f.read()):
                    out.append(pid)
        except OSError:
            pass
    return out


def sweep() -> list[int]:
    """After a cut start: kill the processes it spawned (and theirs: the raylet's agents and workers)
    and reset Ray's state in this process, so that nothing of it outlives the process and Ray's own
    exit hook finds nothing to stop. Once; returns the pids killed."""
    with _LOCK:
        if _STATE["swept"]:
            return []
        _STATE["swept"] = True
    worker = sys.modules.get("ray._private.worker")
    killed: list[int] = []
    try:
        if worker is not None and hasattr(worker.global_worker, "core_worker"):
            _shutdown_ray()  # the driver got connected: Ray's own shutdown, while its daemons still run
        roots = session_children()
        killed = _STATE["killed"] = reaper.kill_tree(roots)
        _reap(roots)
        if worker is not None:
            worker._global_node = None  # its processes are gone: Ray's shutdown only resets its state now
            _shutdown_ray()
    except Exception as exc:  # Ray internals moved: the parent-death signals still stop most of it
        logger.debug("sbloader: sweeping the cut start of Ray: %r", exc)
    return killed


REAP_WAIT_S = 1.0  # the longest wait for the killed children to be collected


def _reap(pids: list[int]) -> None:
    """Collect the killed children's exit statuses, at most :data:`REAP_WAIT_S` seconds (no zombie of
    theirs is left after the process: not every container's init collects orphans)."""
    deadline = time.monotonic() + REAP_WAIT_S
    left = list(pids)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except OSError:  # collected already (by Ray's ``Popen``), or not a child
                pass
            left.remove(pid)
        if left:
            time.sleep(0.005)


def _shutdown_ray() -> None:
    """``ray.shutdown()``, its loggers quiet (nothing is printed at exit)."""
    import ray

    saved = [(log, log.level) for log in map(logging.getLogger, ("ray", "ray._private.worker"))]
    for log, _ in saved:
        log.setLevel(logging.CRITICAL)
    try:
        ray.shutdown()
    finally:
        for log, level in saved:
            log.setLevel(level)
