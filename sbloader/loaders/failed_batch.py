"""A batch whose making raised: delivered in its place, raised when the loop reaches it.

torch's DataLoader raises a ``dataset[i]`` or ``collate_fn`` error for the batch that
hit it and goes on with the next batch when the caller catches it. A remote worker
therefore never lets such an error fail its task (which would end the epoch): it
returns a :class:`FailedBatch` in the batch's slot, and the epoch's iterator raises
it at that batch. An error in ``worker_init_fn`` leaves the worker unusable: its
:class:`FailedBatch` is ``fatal`` and ends the epoch once raised.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Optional

from sbloader.core.errors import UserFunctionError, picklable, reraise_as_torch, torch_exception

WORKER_INIT_FN = "worker_init_fn"


@dataclass(frozen=True)
class FailedBatch:
    """The error that replaced one batch.

    Attributes:
        error: the user's exception (``local``), or a :class:`UserFunctionError`
            carrying it from a remote worker.
        fatal: the epoch cannot go on after it (``worker_init_fn`` failed).
        worker: the remote worker's id (None in this process).
    """

    error: BaseException
    fatal: bool = False
    worker: Optional[int] = None

    @classmethod
    def remote(cls, e: Exception, stage: str, partition_id: int, epoch: int, worker: int,
               fatal: bool = False) -> "FailedBatch":
        """An error caught in a remote worker, made to travel (the traceback as text)."""
        err = UserFunctionError(stage, partition_id, epoch, traceback.format_exc(), repr(e), original=picklable(e))
        return cls(err, fatal, worker)

    def exception(self) -> BaseException:
        """The error as torch's DataLoader would raise it: with its original type (RuntimeError where
        that type cannot be built from a message), ``worker_init_fn``'s naming it. Built, not raised:
        the caller raises it from its own frame and drops its references after (as ``EpochIterator`` does)."""
        err = self.error
        if not isinstance(err, UserFunctionError):
            return err
        if err.operator != WORKER_INIT_FN:
            return torch_exception(err)
        original = err.original  # torch: the original type, "Caught X in DataLoader worker process N"
        msg = (f"Caught {type(original).__name__ if original is not None else 'an error'} in DataLoader worker "
               f"process {self.worker}: worker_init_fn raised {err.cause_repr}. The worker cannot load batches; "
               f"fix worker_init_fn (its traceback below).\nOriginal {err.remote_traceback}")
        try:
            exception = type(original)(msg) if original is not None else RuntimeError(msg)
        except Exception:
            exception = RuntimeError(msg)
        exception.__cause__ = original if original is not None else err  # as `raise ... from`
        return exception


def translate(e: BaseException) -> None:
    """Raise a worker's error as torch's DataLoader does (its original type); else leave it."""
    from sbloader.runtime.loaded_modules import loaded

    if isinstance(e, UserFunctionError):
        reraise_as_torch(e)
    ray = loaded("ray")  # a Ray task's error exists only where Ray was imported
    if ray is not None and isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, UserFunctionError):
        reraise_as_torch(e.cause)
