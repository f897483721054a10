"""A loader's next epoch begun ahead, while the loop still reads the last batches of this one.

A loader's epoch starts with a wait: a fresh execution whose first tasks queue behind whatever
holds the CPUs (in a mixture, the other sources' pipelines), and, split across ranks, the job's
coordinator found (created, the first time) and the epoch joined there. A plain loop meets it
once per epoch; a mixture meets it each time a source runs out and restarts, which a small source
does many times in the others' one epoch. So a mixture's cursor asks its source's loader to begin
the next epoch when two of the current one's batches are left (its length unknown: once they are
all made, :attr:`~sbloader.loaders.epoch.EpochIterator.produced`):
:meth:`PipelineLoader.start_ahead <sbloader.loaders.pipeline_loader.PipelineLoader.start_ahead>`
decides that epoch on the caller's thread (its seed, its plan: what ``iter()`` would decide) and
opens it on a background thread; the next ``iter()`` takes it over. Until then nothing of the
loader's state moves: ``state_dict()`` is the current epoch's. A state loaded, an epoch set or
the loader closed in between closes the epoch begun ahead, as if it had never begun.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional


def functions_only(pipeline: Any) -> bool:
    """Whether every stage of ``pipeline`` is a plain function (no actor pool): two epochs of one
    loader may then run side by side without sharing a pool's actors."""
    from sbloader.executor.stages import build_stages

    return all(s.kind != "actor" for s in build_stages(pipeline.source.name, list(pipeline.ops)))


class Ahead:
    """The next epoch's iterator, opened on a background thread.

    Args:
        open_next: opens the epoch (a loader's decided epoch: it may block, e.g. on the job's coordinator).
        undo: gives the loader back what deciding the epoch took (its epoch count), when the epoch
            begun ahead is dropped unused.
        carry: what the epoch keeps for the next (the loader's ``Carry``, its own copy until it is taken).
    """

    def __init__(self, open_next: Callable[[], Any], undo: Callable[[], None], carry: Any = None) -> None:
        self.carry = carry
        self._it: Any = None
        self._error: Optional[BaseException] = None
        self._undo = undo
        self._thread = threading.Thread(target=self._open, args=(open_next,), name="sbloader-epoch-ahead",
                                        daemon=True)
        self._thread.start()

    def _open(self, open_next: Callable[[], Any]) -> None:
        try:
            self._it = open_next()
        except BaseException as e:  # noqa: BLE001 - raised by take(), where iter() would have raised it
            self._error = e

    def take(self) -> Any:
        """The epoch's iterator (waits for its opening); what opening it raised is raised here."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._it

    def drop(self) -> None:
        """Close the epoch begun ahead and undo its decision (a state loaded, the epoch set, the loader
        closed before the next ``iter()``)."""
        self._thread.join()
        if self._it is not None:
            self._it.close()
            self._it = None
        self._undo()
