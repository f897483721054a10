"""Ray started (or joined) in the background, from the moment a loader is built.

Starting the embedded Ray takes seconds (its daemons, then the first actors); a loader's
first batches never wait for it (:mod:`sbloader.loaders.local_start`). :func:`start`
begins :func:`~sbloader.runtime.session.ensure_initialized` on a daemon thread once per
process and returns at once; :func:`ready` says, without blocking, whether it is done.
An error is kept and raised again by whoever calls ``ensure_initialized`` next (it
retries the start, on the caller's thread, and raises there). At exit, before any ``atexit`` hook
runs (Ray's own shutdown among them), :func:`settle` cuts a start still under way short
(:mod:`sbloader.runtime.start_cut`: it unwinds at its next Python call), waits for it to unwind
and kills what it had spawned: a daemon thread inside Ray's start (C++ under Cython) when the
interpreter finalizes aborts the process ("FATAL: exception not rethrown", or a segfault). A
script that never needed Ray exits without waiting for Ray's start (seconds), then its shutdown.
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

from sbloader.runtime import start_cut
from sbloader.runtime.loaded_modules import loaded

logger = logging.getLogger(__name__)

EXIT_START_WAIT_S = 60.0  # at exit, the longest wait for a background start of Ray to unwind (or end)
_LOCK = threading.Lock()
_STATE: dict = {"thread": None, "done": threading.Event(), "error": None, "exiting": False}


def _run() -> None:
    try:
        from sbloader.runtime.session import ensure_initialized

        ensure_initialized()
    except BaseException as exc:  # raised again where the loader needs Ray (ensure_initialized retries)
        _STATE["error"] = exc
        logger.debug("sbloader: the background Ray start failed: %r", exc)
    finally:
        _STATE["done"].set()


def _quiet_imports() -> None:
    """Keep the start's imports quiet whatever the other threads do with the warning filters.

    ``import ray`` imports ``requests``, which silences urllib3's warning that PySocks is missing
    (``warnings.simplefilter``) just before the import that gives it. A ``warnings.catch_warnings()``
    block on another thread meanwhile (a user's or a library's) restores the filters it
    saw on entry when it ends, dropping that one: the warning was printed, one run in a few on a
    loaded machine. This filter is in place before any such block begins, so every restore keeps it.
    """
    warnings.filterwarnings("ignore", message="SOCKS support in urllib3", module=r"urllib3\.contrib\.socks")


def start() -> None:
    """Start (or join) Ray on a background thread, once per process; return at once."""
    with _LOCK:
        if _STATE["thread"] is not None:
            return
        _quiet_imports()
        thread = threading.Thread(target=_run, name="sbloader-ray-start", daemon=True)
        _STATE["thread"] = thread
        thread.start()
        try:  # before every atexit hook: Ray's own shutdown (registered when ``ray`` is imported, maybe
            # after sbloader's hooks) would reset Ray's state under the start still running
            threading._register_atexit(settle, EXIT_START_WAIT_S)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # another Python, or the process already exits
            pass


def settle(timeout: float) -> bool:
    """The process exits: nothing more is started in the background (:func:`exiting`), a start of Ray
    still under way is cut short (:func:`~sbloader.runtime.start_cut.cut`), and it and the threads
    :func:`spawn` started are waited for, together at most ``timeout`` seconds; what the cut start had
    spawned is killed (:func:`~sbloader.runtime.start_cut.sweep`). Returns whether a start had begun
    (Ray may then be up, with nobody left to stop it: its own exit hooks are registered too late to
    run)."""
    _STATE["exiting"] = True
    start_cut.cut()  # also no start again where one failed (a pool's prestart would retry it)
    started = _STATE["thread"]
    join(timeout, [started] if started is not None else [])
    if start_cut.was_cut(failed()):
        start_cut.sweep()
    return started is not None


def join(timeout: float, first: Sequence[threading.Thread] = ()) -> None:
    """Wait for ``first``, then for every thread :func:`spawn` started, together at most ``timeout``
    seconds (a test's end: the prestarts it began have put their actors where they belong)."""
    deadline = time.monotonic() + timeout
    for thread in list(first) + list(_SPAWNED):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.debug("sbloader: %s still runs after %.0f s", thread.name, timeout)


_SPAWNED: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def spawn(target: Callable[..., Any], args: tuple, name: str) -> None:
    """Run ``target(*args)`` on a daemon thread that the exit waits for (:func:`settle`): work that
    starts Ray actors in the background (a pool's prestart) must not be cut by the interpreter's end."""
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    _SPAWNED.add(thread)
    thread.start()


def exiting() -> bool:
    """Whether the process exits (:func:`settle` ran): background work starts nothing new."""
    return _STATE["exiting"]


def ready() -> bool:
    """Whether Ray is up in this process (started here in the background, or by anyone else)."""
    if _STATE["done"].is_set():
        return _STATE["error"] is None
    ray = loaded("ray")
    return ray is not None and _STATE["thread"] is None and ray.is_initialized()


def failed() -> Optional[BaseException]:
    """The background start's error, if it failed."""
    return _STATE["error"] if _STATE["done"].is_set() else None
