"""Exception classes raised by sbloader.

Every error says what was wrong and what to do about it. Errors raised inside
remote tasks are carried to the consumer and re-raised there with the operator,
the partition and (where known) the file that failed.
"""
from __future__ import annotations

from typing import Optional


class SbloaderError(Exception):
    """Base class of every error sbloader raises on purpose."""


class UserFunctionError(SbloaderError):
    """A user function (``map``, ``map_batches``, ``filter``, ...) raised.

    Attributes:
        operator: name of the operator whose function failed.
        partition_id: the partition being processed.
        epoch: the epoch of the execution.
        remote_traceback: the formatted traceback from the remote worker.
    """

    def __init__(
        self,
        operator: str,
        partition_id: int,
        epoch: int,
        remote_traceback: str,
        cause_repr: str = "",
        path: Optional[str] = None,
    ) -> None:
        self.operator = operator
        self.partition_id = partition_id
        self.epoch = epoch
        self.remote_traceback = remote_traceback
        self.cause_repr = cause_repr
        self.path = path
        where = f" on file {path!r}" if path else ""
        super().__init__(
            f"operator {operator!r} failed on partition {partition_id} (epoch {epoch}){where}: "
            f"{cause_repr}\n--- remote traceback ---\n{remote_traceback}"
        )

    def __reduce__(self):
        return (
            type(self),
            (self.operator, self.partition_id, self.epoch, self.remote_traceback,
             self.cause_repr, self.path),
        )


class SourceReadError(UserFunctionError):
    """A source could not read its input (a corrupt file, a missing column...)."""


class MemoryBudgetError(SbloaderError, ValueError):
    """The memory budget cannot hold what the pipeline needs to make progress."""


class StateDictError(SbloaderError, ValueError):
    """A ``state_dict`` does not match the loader it is loaded into."""


class ExecutorShutdownError(SbloaderError, RuntimeError):
    """The iterator was used after its execution was shut down."""
