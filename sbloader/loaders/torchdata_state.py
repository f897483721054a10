"""torchdata's ``StatefulDataLoader`` state layout (0.11), beside sbloader's own and into it.

Two pure translations, so a run can switch loaders mid-training:

- :func:`torchdata_view`: the ``StatefulDataLoader`` keys of an ``sbloader.DataLoader``
  state (``_snapshot``, ``_worker_snapshots``, ``worker_N``, ``fetcher_state``,
  ``dataset_state``, ``_num_yielded``, ``_iterator_finished`` ...), written beside
  sbloader's exactly-once ledger (``consumed``, ``order``, ``iterable``), which stays
  what sbloader resumes from. The view is for reading (a user's or a test's code that
  looks into the state); the sampler's own iterator state is not in it
  (``_sampler_iter_state`` is None: the order is in sbloader's ``order``), so the
  state stays JSON-serialisable.
- :func:`map_body` / :func:`iterable_body`: a state written by torchdata's ``StatefulDataLoader`` as
  the body of an sbloader state (the caller adds the header): map-style, the batches
  the loop took become consumed positions of the order, the order recomputed from the
  ``RandomSampler``'s generator state; an ``IterableDataset``, each ``worker_N``'s
  dataset and iterator states become shard ``N``'s snapshot.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Optional

from sbloader.core.errors import StateDictError

SNAPSHOT = "_snapshot"
MAIN_SNAPSHOT = "_main_snapshot"
WORKER_SNAPSHOTS = "_worker_snapshots"
SNAPSHOT_STEP = "_snapshot_step"
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"
ITERATOR_FINISHED = "_iterator_finished"
NUM_YIELDED = "_num_yielded"
NUM_WORKERS = "_num_workers"
SAMPLER_ITER_STATE = "_sampler_iter_state"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
FETCHER_STATE = "fetcher_state"
DATASET_STATE = "dataset_state"
DATASET_ITER_STATE = "dataset_iter_state"
FETCHER_ENDED = "fetcher_ended"


@dataclass(frozen=True)
class LoaderShape:
    """What a translation needs of the loader a state is for.

    Attributes:
        num_workers: the loader's ``num_workers``.
        batch_size: its ``batch_size`` (None: no batching).
        dataset_len: the map-style dataset's length (None for an ``IterableDataset``).
        drop_last: its ``drop_last``.
        sampler: the sampler's type name (map-style).
    """

    num_workers: int
    batch_size: Optional[int]
    dataset_len: Optional[int]
    drop_last: bool = False
    sampler: str = ""


def is_torchdata_state(state: Any) -> bool:
    """Whether ``state`` was written by torchdata's ``StatefulDataLoader`` (not by sbloader)."""
    return isinstance(state, dict) and "format" not in state and (SNAPSHOT in state or NUM_YIELDED in state)


def worker_key(worker: int) -> str:
    """StatefulDataLoader's key of worker ``worker``'s snapshot."""
    return f"worker_{worker}"


def _batches_of(samples: int, batch_size: Optional[int]) -> int:
    return samples if not batch_size else -(-samples // batch_size)


def _consumed(state: dict) -> int:
    return sum(int(b) - int(a) for a, b in state.get("consumed") or [])


def torchdata_view(state: dict, num_workers: int, opened: Optional[dict] = None) -> dict:
    """The ``StatefulDataLoader`` keys of the sbloader state ``state``, to write beside it.

    ``_num_yielded`` / ``_snapshot_step``: the batches of the epoch the loop took (0 for a
    state of a fresh epoch, which is also how sbloader records a finished one);
    ``worker_N``: an ``IterableDataset``'s shard ``N`` (its dataset's and iterator's
    states), or, map-style, the dataset's state as the trainer holds it. ``opened``: per
    worker id, ``{"dataset_state", "iter_state"}`` of a shard with no snapshot in ``state``
    (none of its batches taken yet), as its worker has them right after ``iter()``.
    """
    fp = state.get("fingerprint") or {}
    batch_size = fp.get("batch_size")
    iterable = isinstance(state.get("iterable"), dict)
    workers = {}
    if iterable:
        shards = state["iterable"].get("shards") or {}
        taken = sum(_batches_of(int(s.get("samples", 0)), batch_size) for s in shards.values()) \
            if state["iterable"].get("epoch_seed") is not None else 0
        for w in range(max(num_workers, 1)):
            shard = shards.get(str(w)) or (opened or {}).get(w) or {}
            workers[worker_key(w)] = {
                "worker_id": w,
                FETCHER_STATE: {DATASET_ITER_STATE: shard.get("iter_state"), FETCHER_ENDED: bool(shard.get("ended"))},
                DATASET_STATE: shard.get("dataset_state")}
    else:
        if state.get("empty_remainder"):
            n = int(fp.get("len", 0))
            taken = n // batch_size if batch_size and fp.get("drop_last") else _batches_of(n, batch_size)
        else:
            taken = _batches_of(_consumed(state), batch_size)
        for w in range(max(num_workers, 1)):
            workers[worker_key(w)] = {"worker_id": w, FETCHER_STATE: None, DATASET_STATE: state.get("dataset_state")}
    main = {NUM_WORKERS: num_workers, SAMPLER_ITER_STATE: None, "_index_sampler_state": None,
            SAMPLER_ITER_YIELDED: taken, "_IterableDataset_len_called": None, "_shared_seed": None,
            "_base_seed": state.get("base_seed")}
    if num_workers == 0:
        w0 = workers[worker_key(0)]
        return {**{k: v for k, v in main.items() if k not in (NUM_WORKERS, "_base_seed")}, NUM_YIELDED: taken,
                FETCHER_STATE: w0[FETCHER_STATE], DATASET_STATE: w0[DATASET_STATE], ITERATOR_FINISHED: False}
    return {SNAPSHOT: {SNAPSHOT_STEP: taken, LAST_YIELDED_WORKER_ID: (taken - 1) % num_workers,
                       MAIN_SNAPSHOT: main, WORKER_SNAPSHOTS: workers},
            STEPS_SINCE_SNAPSHOT: 0, ITERATOR_FINISHED: False}


@dataclass(frozen=True)
class Progress:
    """Where a ``StatefulDataLoader`` state left its epoch.

    Attributes:
        batches: batches of the epoch the loop took.
        finished: the iterator ran past its end (``_iterator_finished``).
        num_workers: the ``num_workers`` it was written with.
        main: the main process's state (``_main_snapshot``, or the state itself with no workers).
        workers: per worker id, its snapshot (one, id 0, with no workers).
        since_snapshot: batches taken after the workers' snapshots (``_steps_since_snapshot``).
    """

    batches: int
    finished: bool
    num_workers: int
    main: dict
    workers: dict
    since_snapshot: int


def progress(td: dict) -> Progress:
    """Read a ``StatefulDataLoader`` state (0 workers or more)."""
    finished = bool(td.get(ITERATOR_FINISHED, False))
    if SNAPSHOT not in td:
        w0 = {FETCHER_STATE: td.get(FETCHER_STATE), DATASET_STATE: td.get(DATASET_STATE)}
        return Progress(int(td[NUM_YIELDED]), finished, 0, td, {0: w0}, 0)
    snap = td[SNAPSHOT]
    since = int(td.get(STEPS_SINCE_SNAPSHOT, 0))
    main = snap.get(MAIN_SNAPSHOT) or {}
    workers = {int(k.rsplit("_", 1)[1]): v for k, v in (snap.get(WORKER_SNAPSHOTS) or {}).items()}
    return Progress(int(snap[SNAPSHOT_STEP]) + since, finished, int(main.get(NUM_WORKERS, len(workers))), main,
                    workers, since)


def _generator_text(value: Any) -> str:
    """A generator state (a ``torch.ByteTensor``, bytes or a list of ints) as sbloader's base64 text."""
    raw = value.numpy().tobytes() if hasattr(value, "numpy") else bytes(value)
    return base64.b64encode(raw).decode("ascii")


def sampler_order(main: dict, sampler: str) -> dict:
    """sbloader's description of the epoch's order, from a ``StatefulDataLoader`` main state.

    torchdata's ``RandomSampler`` iterator saves its generator's state at the epoch's start
    (``generator``); a ``SequentialSampler`` saves nothing.
    """
    it_state = main.get(SAMPLER_ITER_STATE)
    if isinstance(it_state, dict) and "samples_yielded" in it_state:  # the BatchSampler's iterator
        it_state = it_state.get("sampler_iter_state")
    gen = it_state.get("generator") if isinstance(it_state, dict) else None
    if sampler == "RandomSampler":
        if gen is None:
            raise StateDictError(
                "the StatefulDataLoader state has no RandomSampler generator state (found sampler iterator state "
                f"{it_state!r}) but this loader shuffles; load it into a loader with shuffle=False, as it was taken")
        return {"kind": "rng", "generator": True, "state": _generator_text(gen)}
    if sampler == "SequentialSampler":
        if gen is not None:
            raise StateDictError("the StatefulDataLoader state is of a shuffled epoch (it has a generator state) but "
                                 "this loader does not shuffle; load it into a loader with shuffle=True")
        return {"kind": "sequential"}
    raise StateDictError(f"a StatefulDataLoader state cannot be resumed into a loader with a {sampler}: only its "
                         "RandomSampler and SequentialSampler orders are translated; use shuffle=True/False")


def map_body(td: dict, shape: LoaderShape, epoch: int, epoch_seed: int) -> dict:
    """The body (``epoch``, ``epoch_seed``, ``order``, ``consumed``...) of the sbloader state that
    resumes a map-style ``StatefulDataLoader`` state: the positions of its batches taken so far
    consumed, the rest in the same order. ``epoch``/``epoch_seed``: this loader's next."""
    p = progress(td)
    n = int(shape.dataset_len or 0)
    fresh = {"epoch": epoch, "epoch_seed": None, "order": None, "consumed": []}
    body: dict = dict(fresh)
    ds_state = (p.workers.get(0) or {}).get(DATASET_STATE) if p.num_workers else td.get(DATASET_STATE)
    if ds_state is not None:
        body["dataset_state"] = ds_state
    if p.finished:  # resumes into a fresh epoch, as StatefulDataLoader's finished iterator
        return body
    bs = shape.batch_size or 1
    taken = min(p.batches * bs, n)
    every = (n // bs) * bs if shape.drop_last and shape.batch_size else n
    if taken >= every and p.batches > 0:  # after the epoch's last batch: an empty remainder, then the next
        body["empty_remainder"] = True
        return body
    body.update(epoch_seed=int(epoch_seed), order=sampler_order(p.main, shape.sampler),
                consumed=[[0, taken]] if taken else [])
    return body


def iterable_body(td: dict, shape: LoaderShape, epoch: int) -> dict:
    """The ``iterable`` part of the sbloader state that resumes an ``IterableDataset``'s
    ``StatefulDataLoader`` state: worker ``N``'s dataset and iterator states become shard
    ``N``'s snapshot; a worker with neither is replayed and skips the samples of the
    batches it made (torch deals batch ``i`` to worker ``i % num_workers``)."""
    p = progress(td)
    if p.num_workers != shape.num_workers:
        raise StateDictError(
            f"the StatefulDataLoader state of an IterableDataset was taken with num_workers={p.num_workers}, this "
            f"loader has num_workers={shape.num_workers}: each worker's shard resumes in the worker of its id; "
            "load it into a loader with the same num_workers")
    if p.finished:
        return {"epoch": epoch, "epoch_seed": None, "shards": {}}
    shards = {}
    for w in range(max(p.num_workers, 1)):
        ws = p.workers.get(w) or {}
        fetcher = ws.get(FETCHER_STATE) or {}
        ds, it = ws.get(DATASET_STATE), fetcher.get(DATASET_ITER_STATE)
        if p.since_snapshot and (ds is not None or it is not None):
            raise StateDictError(
                f"the StatefulDataLoader state has {p.since_snapshot} batches after its workers' snapshots "
                "(_steps_since_snapshot): sbloader resumes a shard from its own state only; take the state with "
                "snapshot_every_n_steps=1 (the default)")
        made = len(range(w, p.batches, max(p.num_workers, 1)))
        samples = made * shape.batch_size if shape.batch_size else made
        shards[str(w)] = {"samples": samples, "batches": made, "dataset_state": ds, "iter_state": it,
                          "ended": bool(fetcher.get(FETCHER_ENDED, False))}
    return {"epoch": epoch, "epoch_seed": None, "shards": shards}
