"""How a Ray call's failure reaches the consumer, and how a call's shared argument travels.

A call that fails because the cluster lost something (its actor, its node, an
object it needed) is a failure of the system, not of the user's code: its
partitions run again elsewhere from their provenance (:class:`Rerun`), at most
:data:`MAX_RERUNS` times per partition. Anything else reaches the consumer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray

from sbloader.core.errors import SbloaderError, TaskLostError, missing_module
from sbloader.executor.task_args import Packed, pack, share

_INLINE_ARG_BYTES = 64 * 1024

#: Times one partition is run again after failures of the system before its call's error is raised.
MAX_RERUNS = 4


@dataclass(frozen=True)
class Rerun:
    """A call's result that the system lost (see :func:`system_failure`): run its partition again."""

    error: BaseException


def system_failure(e: BaseException) -> bool:
    """Whether a call failed because the cluster lost something, not because of the user's code.

    A pool actor unreachable or dead (its node died, its process was killed), a node
    gone, an object lost with its node: the work can run again elsewhere. An actor
    whose constructor raised is the user's error (it would fail again); so is
    everything a task raised itself.
    """
    if isinstance(e, ray.exceptions.ActorDiedError) and getattr(e, "actor_init_failed", False):
        return False
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError,
                          ray.exceptions.ObjectLostError, ray.exceptions.LocalRayletDiedError))


def unwrap(e: BaseException) -> BaseException:
    """The sbloader error inside a Ray task error, else the error itself."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, SbloaderError):
        return cause
    return e


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def lost(stage_name: str, epoch: int, items: Sequence[tuple], partition_id: int, e: BaseException) -> TaskLostError:
    """A call's failure outside the user's functions, as a :class:`TaskLostError` naming the
    call's partitions (``items``: its ``(plan position, Partition)`` pairs; Ray's own error
    names none)."""
    parts = [part for _, part in items]
    ids = tuple(p.id for p in parts) or (partition_id,)
    labels = tuple(p.label for p in parts)
    first = _ANSI.sub("", (str(e).strip().splitlines() or [""])[0])  # Ray colours the task's name
    cause = f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
    module = missing_module(e)
    if module:
        cause = f"ModuleNotFoundError: No module named {module!r}"
    err = TaskLostError(stage_name, epoch, ids, labels, cause, module)
    err.__cause__ = e
    return err


def _take_errors(run: Any, inflight: dict) -> None:
    """Fetch the other refs of a failed call (its block ref, and each other partition's pair when it read
    several): they hold the same error, and Ray prints an error nobody fetched as an "unhandled error"
    when its ref is dropped (a user's failing function showed Ray's traceback beside ours)."""
    refs = [run.block_ref] + [ref for m, o in inflight.items() if o is not run and o.call is run.call
                              for ref in (m, o.block_ref)]
    for ref in refs:
        try:
            ray.get(ref, timeout=0)
        except Exception:
            pass


def sort_failures(refs: Sequence[Any], inflight: dict, other_copy: Callable[[Any], bool],
                  stage_names: Sequence[str], epoch: int) -> list:
    """After a failed batch ``ray.get`` of metadata refs: each ref's metadata, or None for a
    failed copy of a partition that another copy delivered or may still deliver (a
    speculated partition), or a :class:`Rerun` for a call the system lost
    (:func:`system_failure`: the caller runs it again). Any other failure is raised, as a
    :class:`~sbloader.core.errors.TaskLostError` when it happened outside the user's functions.

    Args:
        refs: the metadata refs.
        inflight: their records (metadata ref -> ``Running``).
        other_copy: whether another copy of a record's partition covers it.
        stage_names: the stages' names.
        epoch: the epoch.
    """
    metas = []
    for r in refs:
        try:
            metas.append(ray.get(r))
        except Exception as e:
            run = inflight[r]
            _take_errors(run, inflight)
            if not other_copy(run):
                if system_failure(e):
                    metas.append(Rerun(e))
                    continue
                if unwrap(e) is e:
                    raise lost(stage_names[run.stage], epoch, run.call.items, run.partition_id, e)
                raise
            metas.append(None)
    return metas


def shared_arg(payload: Any) -> Any:
    """The read tasks' shared argument: by value when small, else one object in the store, named by its
    digest (:class:`~sbloader.executor.task_args.SharedRef`: unpickled once per worker process, not once a task).

    By value matters for placement: a task whose argument lives in the trainer
    node's object store can be leased there by Ray's locality-aware scheduling
    despite a node-label constraint.
    """
    packed = pack(payload)  # pickled once here, not once per task
    if isinstance(packed, Packed):  # (large: in the store once, unpickled once per worker process, #47)
        return packed if len(packed.data) <= _INLINE_ARG_BYTES else share(packed)
    import ray.cloudpickle as cloudpickle

    try:  # it holds Ray handles: by value through Ray's serialisation when small
        if len(cloudpickle.dumps(payload)) <= _INLINE_ARG_BYTES:
            return payload
    except Exception:  # not picklable by value here: let Ray's own serialisation say why
        pass
    return ray.put(payload)
