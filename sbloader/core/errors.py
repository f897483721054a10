"""Exception classes raised by sbloader.

Every error says what was wrong and what to do about it. Errors raised inside
remote tasks are carried to the consumer and re-raised there with the operator,
the partition and (where known) the file that failed.
"""
from __future__ import annotations

import re

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


class ResourceError(SbloaderError):
    """The nodes a pipeline may use cannot hold what its stages need to make progress."""


class SourceReadError(UserFunctionError):
    """A source could not read its input (a corrupt file, a missing column...)."""


def workers_path_hint() -> str:
    """What to do when Ray's workers cannot import a module this process imports."""
    return ("A function or dataset class of this loader comes from that module and Ray's workers import it by "
            "name, but they do not see folders added to sys.path after Ray started, nor folders missing on "
            "their node: put the module's folder on their path (PYTHONPATH in the environment that starts Ray "
            "or its nodes, or sbloader.init(runtime_env={'py_modules': [the imported module]})), or install it "
            "on every node.")


def missing_module(e: BaseException) -> str:
    """The module a worker could not import where ``e`` (Ray's error, or what it wraps) comes from a
    ``ModuleNotFoundError``: a function or class sent by name from a module not on the workers' path;
    "" for any other failure."""
    for err in (e, getattr(e, "cause", None), e.__cause__):
        if isinstance(err, ModuleNotFoundError) and getattr(err, "name", None):
            return err.name
    text = str(e)
    if "ModuleNotFoundError" in text or isinstance(e, ModuleNotFoundError):
        found = re.search(r"No module named '([^']+)'", text)
        if found:
            return found.group(1)
    return ""


class TaskLostError(SbloaderError, RuntimeError):
    """A task (or pool actor call) failed outside the user's functions: its worker
    process died (killed, out of memory, a crash in native code such as a decoder)
    and Ray's retries ran out, its node went away, or Ray could not run it or store
    its output. The Ray error is the ``__cause__``.

    Attributes:
        stage: name of the stage the task ran.
        epoch: the epoch of the execution.
        partition_ids: the partitions the task covered.
        labels: their names (files, row ranges) where the source gives them.
        cause_repr: the Ray error, shortened.
        missing_module: the module the worker could not import ("" for another failure): a
            function of the pipeline was sent by name from a module the workers cannot find.
    """

    def __init__(self, stage: str, epoch: int, partition_ids: tuple, labels: tuple = (),
                 cause_repr: str = "", missing_module: str = "") -> None:
        self.stage = stage
        self.epoch = epoch
        self.partition_ids = tuple(partition_ids)
        self.labels = tuple(labels)
        self.cause_repr = cause_repr
        self.missing_module = missing_module
        named = [str(x) for x in self.labels if x][:3]
        reading = f" (reading {', '.join(named)}{', ...' if len(self.labels) > 3 else ''})" if named else ""
        if missing_module:
            super().__init__(
                f"a {stage!r} task on partition(s) {list(self.partition_ids)} (epoch {epoch}) could not start: "
                f"its worker cannot import module {missing_module!r} ({cause_repr}). {workers_path_hint()}"
            )
            return
        super().__init__(
            f"a {stage!r} task on partition(s) {list(self.partition_ids)} (epoch {epoch}){reading} failed "
            f"outside the user's functions: {cause_repr}. A task whose worker died was retried before this "
            "(max_task_retries); the worker's log in Ray's session folder (logs/worker-*.err, e.g. under "
            "/tmp/ray/session_latest) says why: a worker killed for memory needs smaller partitions or fewer concurrent tasks "
            "(concurrency=, num_cpus=); a crash in native code such as a decoder points at the input named "
            "here (on_error='skip' cannot catch a crash: remove or re-encode that input)."
        )

    def __reduce__(self):
        return (type(self), (self.stage, self.epoch, self.partition_ids, self.labels, self.cause_repr,
                             self.missing_module))


class WorkerStartError(SbloaderError, RuntimeError):
    """A loader's workers did not start within their start-up bound (``start_timeout``)."""


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
    """Raise a worker's error the way torch's DataLoader does: :func:`torch_exception`."""
    raise torch_exception(err)


def torch_exception(err: UserFunctionError) -> BaseException:
    """A worker's error as torch's DataLoader raises it: the original type.

    torch re-raises ``Caught <Type> in DataLoader worker process N. Original
    Traceback ...`` as the original exception type (RuntimeError when that type
    cannot be built from a message); user code that catches specific types keeps
    working. The sbloader error stays attached as the cause. Built, not raised: the
    caller raises it from its own frame (no frame of this module in a reference cycle
    with the exception).
    """
    original = err.original
    if original is None:
        return err
    exc_type = type(original)
    msg = (f"Caught {exc_type.__name__} in DataLoader worker (partition {err.partition_id}, "
           f"epoch {err.epoch}).\nOriginal {err.remote_traceback}")
    if exc_type is KeyError:
        msg = _KeyErrorMessage(msg)
    try:
        exception = exc_type(msg)
    except Exception:
        exception = RuntimeError(msg)
    exception.__cause__ = err  # as `raise ... from err`
    return exception


class _KeyErrorMessage(str):
    """KeyError's str() quotes its message; this keeps newlines readable, as torch does."""

    def __repr__(self) -> str:
        return self
