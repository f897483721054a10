"""Epochs and loaders dropped without a ``close()`` are closed on a thread of their own, not in ``__del__``.

A ``__del__`` runs wherever the garbage collector does: inside ``Thread.start`` of a
torch worker queue, inside a lock another thread needs, on the epoch's own fetch thread.
Closing an epoch there (joining its fetch thread, killing or parking Ray actors) can wait
for good on what the interrupted frame holds. So ``__del__`` only hands the epoch to this
module's queue (``SimpleQueue.put`` is reentrant, made for ``__del__``) and one daemon
thread closes it at once. :func:`drain` waits for the close in hand and closes what is
still queued, on the caller's thread (before the embedded Ray stops, and at exit: a close
still running on the daemon thread when the interpreter finalizes dies inside torch's
tensor destructor, and the process aborts).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

_QUEUE: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_LOCK = threading.Lock()
_BUSY = threading.Lock()  # held by the closer thread while it closes one
_STATE: dict = {"thread": None, "taken": False}


def start() -> None:
    """Start the closer thread once per process (from a constructor, never from a ``__del__``)."""
    with _LOCK:
        if _STATE["thread"] is None:
            thread = threading.Thread(target=_run, name="sbloader-epoch-closer", daemon=True)
            _STATE["thread"] = thread
            thread.start()


def close_later(obj: Any) -> None:
    """Have ``obj.close()`` called on the closer thread (safe in a ``__del__``)."""
    _QUEUE.put(obj.close)


def call_later(fn: Any) -> None:
    """Have ``fn()`` called on the closer thread (safe in a ``__del__``)."""
    _QUEUE.put(fn)


def drain(wait_s: float = 10.0) -> None:
    """Run every close still queued here, and wait (together at most ``wait_s`` seconds) for the
    one the closer thread is running: when this returns, nothing handed over before it is still
    being closed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fn = _QUEUE.get_nowait()
        except queue.Empty:
            fn = None
        if fn is not None:
            _call(fn)
            fn = None
            continue
        if threading.current_thread() is _STATE["thread"]:
            return
        if not _BUSY.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return  # a close that does not end: the caller goes on
        taken = _STATE["taken"]  # the closer thread holds one it has not begun: it runs it next
        _BUSY.release()
        if not taken and _QUEUE.empty():
            return
        time.sleep(0.001)


def _call(fn: Any) -> None:
    try:
        fn()
    except Exception:  # a dropped epoch's teardown has nobody to raise to
        pass


def _run() -> None:
    while True:
        fn = _QUEUE.get()
        _STATE["taken"] = True
        with _BUSY:
            _STATE["taken"] = False
            _call(fn)
            fn = None  # the epoch (and the batches it held) is dropped under the lock too
