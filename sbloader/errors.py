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
        original: the exception the user function raised, when it could be pickled.
    """

    def __init__(
        self,
        operator: str,
        partition_id: int,
        epoch: int,
        remote_traceback: str,
        cause_repr: str = "",
        path: Optional[str] = None,
        original: Optional[BaseException] = None,
    ) -> None:
        self.operator = operator
        self.original = original
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
             self.cause_repr, self.path, self.original),
        )


class SourceReadError(UserFunctionError):
    """A source could not read its input (a corrupt file, a missing column...)."""


class MemoryBudgetError(SbloaderError, ValueError):
    """The memory budget cannot hold what the pipeline needs to make progress."""


class StateDictError(SbloaderError, ValueError):
    """A ``state_dict`` does not match the loader it is loaded into."""


class ExecutorShutdownError(SbloaderError, RuntimeError):
    """The iterator was used after its execution was shut down."""


def picklable(e: BaseException) -> Optional[BaseException]:
    """``e`` if it survives pickling (so it can travel to the consumer), else None."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return None


def reraise_as_torch(err: UserFunctionError) -> None:
    """Raise a worker's error the way torch's DataLoader does: the original type.

    torch re-raises ``Caught <Type> in DataLoader worker process N. Original
    Traceback ...`` as the original exception type (RuntimeError when that type
    cannot be built from a message); user code that catches specific types keeps
    working. The sbloader error stays attached as the cause.
    """
    original = err.original
    if original is None:
        raise err
    exc_type = type(original)
    msg = (f"Caught {exc_type.__name__} in DataLoader worker (partition {err.partition_id}, "
           f"epoch {err.epoch}).\nOriginal {err.remote_traceback}")
    if exc_type is KeyError:
        msg = _KeyErrorMessage(msg)
    try:
        exception = exc_type(msg)
    except Exception:
        raise RuntimeError(msg) from err
    raise exception from err


class _KeyErrorMessage(str):
    """KeyError's str() quotes its message; this keeps newlines readable, as torch does."""

    def __repr__(self) -> str:
        return self
