"""Checkpoint state of a native pipeline loader: a ledger of consumed partition rows.

A partition replays bit for bit (its members, rows and augmentations derive from
the epoch seed and its id), and the consumer takes each partition's output rows in
order (the shuffle window draws a prefix of every open partition). So the state is
the set of partitions fully consumed plus, for the few partly consumed, how many of
their output rows were taken; resuming re-runs the unfinished partitions and drops
those first rows. Partitions are named by their place in the epoch's plan, which
the epoch seed fixes: consumption follows the plan, so the places consumed are a
few ranges however the plan permutes the ids (version 2; version 1 named ids).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

from . import ledger
from .block import Block, BlockMeta, slice_block
from .errors import StateDictError

STATE_FORMAT = "sbloader.PipelineLoader"
STATE_VERSION = 2


@dataclass
class PipelineRun:
    """One (possibly resumed) epoch of a native pipeline loader.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed.
        done: ids of partitions fully consumed (before and during this run).
        taken: rows consumed so far per partition not yet done.
        totals: output rows of each partition seen in this run.
        complete: the epoch ran to its end.
        order: the partition ids of the epoch's whole plan, in order (every rank's).
        batches: batches the training loop took in this epoch (before and during this
            run; padding left out): a resumed epoch's shuffle window goes on counting.
    """

    epoch: int
    epoch_seed: int
    done: set = field(default_factory=set)
    taken: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    complete: bool = False
    order: tuple = ()
    batches: int = 0

    def see(self, partition_id: int, rows: int) -> None:
        """Record a partition's output rows (it is done at once when nothing of it is left)."""
        self.totals[partition_id] = rows
        if rows == 0 or self.taken.get(partition_id, 0) >= rows:
            self.done.add(partition_id)
            self.taken.pop(partition_id, None)

    def consume(self, parts: tuple) -> None:
        """Record a batch handed to the training loop (``parts``: ``(partition id, rows)``;
        empty for a batch of padding)."""
        if parts:
            self.batches += 1
        for pid, n in parts:
            self.taken[pid] = self.taken.get(pid, 0) + n
            if pid in self.totals and self.taken[pid] >= self.totals[pid]:
                self.done.add(pid)
                del self.taken[pid]


def skip_consumed(blocks: Iterator[tuple[Block, BlockMeta]], run: PipelineRun,
                  facts: list) -> Iterator[tuple[Block, BlockMeta]]:
    """Drop the rows a resumed partition had already delivered.

    Each partition's output rows are appended to ``facts`` as ``(partition id,
    rows)`` for the consumer to record with :meth:`PipelineRun.see`: this generator
    runs in the fetch thread and only reads ``run``.
    """
    for block, meta in blocks:
        pid = meta.partition_id
        skip = run.taken.get(pid, 0)
        facts.append((pid, meta.num_rows))
        if meta.num_rows == 0 or skip >= meta.num_rows:
            continue
        if skip:
            block = slice_block(block, skip, meta.num_rows)
            meta = replace(meta, num_rows=meta.num_rows - skip)
        yield block, meta


def fingerprint(loader: Any) -> dict:
    """What a state must match: the pipeline, its source and the batching."""
    return {
        "pipeline": repr(loader.dataset),
        "source": loader.dataset.source.fingerprint(),
        "batch_size": loader.batch_size,
        "shuffle": bool(loader.shuffle),
    }


def make_state(loader: Any, run: Optional[PipelineRun]) -> dict:
    """The JSON-serialisable state."""
    base = {"format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": fingerprint(loader)}
    fresh = {"epoch_seed": None, "done": [], "partial": {}, "batches": 0}
    if run is None:
        if loader._resume is not None:
            return dict(loader._resume)
        return {**base, "epoch": int(loader._epoch), **fresh}
    if run.complete:
        return {**base, "epoch": run.epoch + 1, **fresh}
    place = {pid: i for i, pid in enumerate(run.order)}
    return {**base, "epoch": run.epoch, "epoch_seed": run.epoch_seed,
            "done": [list(r) for r in ledger.from_positions(place[pid] for pid in run.done)],
            "partial": {str(place[pid]): int(n) for pid, n in sorted(run.taken.items(), key=lambda kv: place[kv[0]])
                        if n > 0},
            "batches": int(run.batches)}


def validate(loader: Any, state: Any, strict: bool) -> dict:
    """Check a state against the loader ("found X, expected Y"); a version-1 state of an
    unshuffled loader is read as version 2 (its partition ids are its places)."""
    from ._state_check import check_state

    if isinstance(state, dict) and state.get("format") == STATE_FORMAT and state.get("version") == 1:
        state = _upgrade_v1(state)
    return check_state(state, fmt=STATE_FORMAT, version=STATE_VERSION, required=("done", "partial"),
                       fingerprint=fingerprint(loader), strict=strict)


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
    return {**state, "version": STATE_VERSION, "batches": 0}


def run_from_state(state: dict, order: tuple) -> PipelineRun:
    """The run a loaded state resumes, given its epoch's plan ``order`` (partition ids)."""
    places = ledger.to_positions(state.get("done", []))
    if len(places) and int(places.max()) >= len(order):
        raise StateDictError(
            f"the state names place {int(places.max())} of an epoch of {len(order)} partitions; load it "
            "into a loader over the same data"
        )
    return PipelineRun(
        epoch=int(state["epoch"]),
        epoch_seed=int(state["epoch_seed"]),
        done={order[int(p)] for p in places},
        taken={order[int(k)]: int(v) for k, v in state.get("partial", {}).items()},
        order=tuple(order),
        batches=int(state.get("batches", 0)),
    )


def merge_runs(runs: list) -> Optional[PipelineRun]:
    """One run from every rank's (each rank consumed its own partitions)."""
    live = [r for r in runs if r is not None]
    if not live:
        return None
    first = live[0]
    if any((r.epoch, r.epoch_seed) != (first.epoch, first.epoch_seed) for r in live):
        raise StateDictError(
            f"ranks are in different epochs: found {sorted({(r.epoch, r.epoch_seed) for r in live})}; "
            "call state_dict() on every rank at the same step"
        )
    merged = PipelineRun(first.epoch, first.epoch_seed, complete=all(r.complete for r in live),
                         order=first.order, batches=min(r.batches for r in live))
    for r in live:
        merged.done |= r.done
        merged.taken.update(r.taken)
        merged.totals.update(r.totals)
    return merged
