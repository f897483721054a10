"""The checkpoint state of a native pipeline loader (format ``sbloader.PipelineLoader``).

Partitions are named by their place in the epoch's plan, which the epoch seed
fixes: consumption follows the plan, so the places consumed are a few ranges
however the plan permutes the ids. The body: ``epoch_seed``, ``done`` (places of
the partitions fully consumed, as ranges), ``partial`` (place -> output rows taken
of the few partly consumed) and ``batches`` (batches taken, so a resumed epoch's
shuffle window draws as the uninterrupted one would) and, for a budget shuffle window,
``window`` (``[cap, unit]``: the window the epoch started with). Over 64 partly
consumed partitions (a wide window), their counts are packed (``partial_packed``,
:func:`~sbloader.core.ledger.pack_counts`). A state that credited the first rows of
every rank's pending batch (a mixture resumed on another world size) also has
``ahead`` (place -> ranges of rows consumed past its ``partial`` count,
:mod:`~sbloader.core.row_ledger`). Version 4 (versions 2 and 3 had none of the
optional keys newer than them and load as they are); version 1 named
partition ids, which an unshuffled epoch's places are (read as version 2), and a
shuffled one's are not (refused with the reason).
"""
from __future__ import annotations

from typing import Any, Optional

from sbloader.core import ledger
from sbloader.core.errors import StateDictError
from sbloader.core.state import StateFormat
from sbloader.loaders.pipeline_run import PipelineRun

STATE_VERSION = 4


def _upgrade_v1(state: dict) -> dict:
    """A version-1 state as version 2, where it means the same; else a clear refusal."""
    if state.get("fingerprint", {}).get("shuffle") and state.get("epoch_seed") is not None:
        raise StateDictError(
            "state version: found 1, expected 2. A version-1 state of a shuffled epoch named partitions as "
            "sbloader cut them before shuffle=True drew each partition's members from the epoch seed; those "
            "partitions no longer exist, so its epoch cannot be replayed exactly. Load it with the sbloader "
            "release that wrote it, or start that epoch again: set state['epoch_seed'] = None, "
            "state['done'] = [], state['partial'] = {} and state['version'] = 2"
        )
    # Unshuffled (or between epochs): the plan is the ids in order, so an id is its place.
    return {**state, "version": 2, "batches": 0}


def _upgrade_v2(state: dict) -> dict:
    """Version 3 only adds optional keys (``partial_packed``, ``window``): a version-2 state means the same."""
    return {**state, "version": 3}


def _upgrade_v3(state: dict) -> dict:
    """Version 4 only adds the optional ``ahead``: a version-3 state means the same."""
    return {**state, "version": 4}


FORMAT = StateFormat("sbloader.PipelineLoader", STATE_VERSION, ("done", "partial"),
                     {1: _upgrade_v1, 2: _upgrade_v2, 3: _upgrade_v3})


def fingerprint(pipeline: Any, batch_size: Optional[int], shuffle: bool) -> dict:
    """What a state must match: the pipeline, its source and the batching."""
    return {"pipeline": repr(pipeline), "source": pipeline.source.fingerprint(), "batch_size": batch_size,
            "shuffle": bool(shuffle)}


def make_state(fp: dict, epoch: int, run: Optional[PipelineRun]) -> dict:
    """The JSON-serialisable state: of ``run`` (its progress), or of a fresh ``epoch`` (``run`` None)."""
    fresh = {"epoch_seed": None, "done": [], "partial": {}, "batches": 0}
    if run is None:
        return {**FORMAT.header(fp), "epoch": int(epoch), **fresh}
    if run.complete or (run.order and len(run.done) >= len(run.order)):
        return {**FORMAT.header(fp), "epoch": run.epoch + 1, **fresh}  # the epoch is done: start the next cleanly
    place = {pid: i for i, pid in enumerate(run.order)}
    partial = sorted(((place[pid], int(n)) for pid, n in run.taken.items() if n > 0))
    counts = ({"partial": {str(p): n for p, n in partial}} if len(partial) <= ledger.PACK_ABOVE
              else {"partial": {}, "partial_packed": ledger.pack_counts(dict(partial))})
    return {**FORMAT.header(fp), "epoch": run.epoch, "epoch_seed": run.epoch_seed,
            "done": [list(r) for r in ledger.from_positions(place[pid] for pid in run.done)],
            **counts, "batches": int(run.batches),
            **({"window": list(run.window)} if run.window else {}),
            **({"ahead": {str(place[pid]): [list(r) for r in ranges] for pid, ranges in sorted(run.ahead.items())
                          if pid not in run.done}} if run.ahead else {})}


def run_from_state(state: dict, order: tuple) -> PipelineRun:
    """The run a loaded state resumes, given its epoch's plan ``order`` (partition ids)."""
    places = ledger.to_positions(state.get("done", []))
    partial = {int(k): int(v) for k, v in state.get("partial", {}).items()}
    try:
        partial.update(ledger.unpack_counts(state["partial_packed"]) if state.get("partial_packed") else {})
    except Exception as e:  # a damaged string: say so rather than resume wrongly
        raise StateDictError(f"state partial_packed: found a value that does not unpack ({e}); expected what "
                             "state_dict() wrote") from None
    ahead = _ahead(state.get("ahead"))
    named = [int(p) for p in places] + list(partial) + list(ahead)
    if named and max(named) >= len(order):
        raise StateDictError(
            f"the state names place {max(named)} of an epoch of {len(order)} partitions; load it into a loader "
            "over the same data"
        )
    return PipelineRun(
        epoch=int(state["epoch"]),
        epoch_seed=int(state["epoch_seed"]),
        done={order[int(p)] for p in places},
        taken={order[k]: v for k, v in partial.items()},
        order=tuple(order),
        batches=int(state.get("batches", 0)),
        window=_window(state.get("window")),
        ahead={order[k]: v for k, v in ahead.items()},
    )


def _window(value: Any) -> Optional[list]:
    """A state's ``window`` (``[cap, "rows" | "bytes"]``) checked, or None."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2 or not isinstance(value[0], int)
            or value[0] < 1 or value[1] not in ("rows", "bytes")):
        raise StateDictError(f"state window: found {value!r}, expected [cap >= 1, 'rows' or 'bytes'] or no window")
    return [int(value[0]), str(value[1])]


def _ahead(value: Any) -> dict:
    """A state's ``ahead`` (place -> ``[[start, stop], ...]``) checked, as place -> ranges."""
    if value is None:
        return {}
    try:
        out = {int(k): [(int(a), int(b)) for a, b in v] for k, v in value.items()}
    except (AttributeError, TypeError, ValueError):
        out = None
    if out is None or any(a < 0 or b <= a for v in out.values() for a, b in v):
        raise StateDictError(f"state ahead: found {value!r}, expected {{place: [[start, stop], ...]}} with "
                             "0 <= start < stop, as state_dict() wrote it")
    return out
