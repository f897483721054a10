"""Epochs and loaders dropped without a ``close()`` are closed on a thread of their own, not in ``__del__``.

A ``__del__`` runs wherever the garbage collector does: inside ``Thread.start`` of a
torch worker queue, inside a lock another thread needs, on the epoch's own fetch thread.
Closing an epoch there (joining its fetch thread, killing or parking Ray actors) can wait
for good on what the interrupted frame holds. So ``__del__`` only hands the epoch to this
module's queue (``SimpleQueue.put`` is reentrant, made for ``__del__``) and one daemon
thread closes it at once. :func:`drain` closes what is still queued, on the caller's
thread (before the embedded Ray stops).
"""
from __future__ import annotations

import queue
import threading
from typing import Any

_QUEUE: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_LOCK = threading.Lock()
_STATE: dict = {"thread": None}


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


def drain() -> None:
    """Run every close still queued, here."""
    while True:
        try:
            fn = _QUEUE.get_nowait()
        except queue.Empty:
            return
        _call(fn)


def _call(fn: Any) -> None:
    try:
        fn()
    except Exception:  # a dropped epoch's teardown has nobody to raise to
        pass


def _run() -> None:
    while True:
        fn = _QUEUE.get()
        _call(fn)
        del fn
