"""Resume of an ``IterableDataset``: each worker shard's position, saved with the loader's state.

An ``IterableDataset`` has no index to replay, so its resume is per worker shard
(``get_worker_info().id``), as torchdata's ``StatefulDataLoader`` does:

- the shard's worker snapshots, after each batch it makes, the dataset's own
  ``state_dict()`` (when the dataset implements it and is not its own iterator) and
  the iterator's (when the iterator implements it), with the samples the shard has
  produced so far (:func:`iterate_shard`);
- the trainer keeps the snapshot of the last batch the loop *took* from each shard
  (:class:`IterableRun`); ``state_dict()`` returns them;
- on resume the worker calls ``dataset.load_state_dict``, then ``iter(dataset)``,
  then ``iterator.load_state_dict``. A shard with neither state is replayed from its
  start and its first ``samples`` samples are skipped (the cost: they are produced
  again): exactly once where the dataset is deterministic (each shard runs under the
  epoch's seed, saved in the state).

A snapshot is ``{"samples": n, "batches": k, "dataset_state": ..., "iter_state": ...,
"ended": bool, "origin": ..., "tracks": bool or None}``; ``batches``: the shard's batches so far
(its place in torch's round-robin, :mod:`~sbloader.loaders.shard_order`); ``ended``: the
shard has nothing after this batch. ``end_state``: the dataset's state
once the shard was exhausted (what a resumed *next* epoch starts from).

**sbloader's own reopens.** A shard is also reopened by sbloader itself, from the snapshot
of its last batch made: a segment that lands on another actor, the pool taking over from
the local workers, a lost block made again. Those must be exactly once whatever the
dataset's state holds, as torch's loader, which never reopens, is. So every snapshot says
where its *chain* began (``origin``: the user's resume of the shard, None: the shard's
start in the epoch) and whether the state moved at every batch since (``tracks``; None
until two batches in a row were compared). A reopen trusts the state only where it
tracked; otherwise it goes back to the origin and skips the samples made since
(:func:`reopen_position`): a state that never changes (torchdata's ``CountIterCalls``
counts ``__iter__`` calls) cannot say where the shard stands. The user's ``state_dict()`` holds neither key (:func:`public_snapshot`): a user's
resume is trusted, as torchdata trusts it.
"""
from __future__ import annotations

import copy
import itertools
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` implements torchdata's ``Stateful`` protocol (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _snapshot(dataset: Any, it: Any, samples: int, batches: int) -> dict:
    ds_state = copy.deepcopy(dataset.state_dict()) if is_stateful(dataset) and it is not dataset else None
    it_state = copy.deepcopy(it.state_dict()) if is_stateful(it) else None
    return {"samples": samples, "batches": batches, "dataset_state": ds_state, "iter_state": it_state,
            "ended": False}


def batches_before(resume: Optional[dict]) -> int:
    """The batches a shard made before ``resume`` (0 from its start; a state without the count: 0)."""
    return int((resume or {}).get("batches", 0))


#: The keys of a snapshot that only sbloader's own reopens read (the user's state holds neither).
CHAIN_KEYS = ("origin", "tracks")


def public_snapshot(snap: dict) -> dict:
    """``snap`` as the user's ``state_dict()`` holds it: without its chain (:data:`CHAIN_KEYS`)."""
    return {k: v for k, v in snap.items() if k not in CHAIN_KEYS}


def chain_origin(resume: Optional[dict]) -> Optional[dict]:
    """Where the chain of a shard opened at ``resume`` began: the chain's own origin when ``resume``
    is one of sbloader's snapshots, else ``resume`` itself (a user's resume; None: the shard's start)."""
    if resume is None:
        return None
    if "origin" in resume:
        return resume["origin"]
    return {k: resume.get(k) for k in ("samples", "dataset_state", "iter_state")}


def reopen_position(resume: Optional[dict]) -> Optional[dict]:
    """Where :func:`open_shard` places a shard asked to start at ``resume``: ``resume`` itself when
    it is a user's resume or its chain's state moved at every batch; otherwise its chain's origin
    and the samples made since skipped (:func:`handover_position`)."""
    if not resume or "origin" not in resume or resume.get("tracks") is True or resume.get("skip") is not None:
        return resume
    return handover_position(resume["origin"], resume)


def open_shard(dataset: Any, resume: Optional[dict]) -> tuple[Iterator, int]:
    """``iter(dataset)`` positioned where ``resume`` left the shard, and the samples before it.

    Order (torchdata's): the dataset's state, then ``iter()``, then the iterator's state;
    without either state the first ``resume["samples"]`` samples are skipped. A handover's
    position (:func:`handover_position`) then skips its ``skip`` samples. One of sbloader's own
    snapshots is placed by :func:`reopen_position` first.
    """
    resume = reopen_position(resume)
    if resume and resume.get("dataset_state") is not None and is_stateful(dataset):
        dataset.load_state_dict(resume["dataset_state"])
    it = iter(dataset)
    samples = int(resume.get("samples", 0)) if resume else 0
    skip = int(resume.get("skip") or 0) if resume else 0
    if resume and resume.get("iter_state") is not None and is_stateful(it):
        it.load_state_dict(resume["iter_state"])
    elif resume and resume.get("dataset_state") is None and resume.get("skip") is None:
        skip = samples  # count and skip: the documented cost
    _take(it, skip)
    return it, samples


def handover_position(start: Optional[dict], snap: dict) -> dict:
    """Where the pool resumes a shard whose batches up to ``snap`` the local workers made (the local
    start's handover, :mod:`~sbloader.loaders.iterable_start`): the shard's own start (``start``, the
    epoch's resume of it; None: its beginning), then the samples made since skipped (``skip``).

    Never the dataset's state after those batches: a user's resume trusts it, as torchdata does,
    but the handover is sbloader's own, and a state that does not hold the shard's position (a
    counter of ``__iter__`` calls, torchdata's ``CountIterCalls``) would replay the shard's first
    batches. The cost: the local phase's samples of the shard are made again, once."""
    start = start or {}
    stated = start.get("dataset_state") is not None or start.get("iter_state") is not None
    skip = int(snap.get("samples", 0)) - (int(start.get("samples", 0)) if stated else 0)
    return {**snap, "dataset_state": start.get("dataset_state"), "iter_state": start.get("iter_state"),
            "skip": max(0, skip)}


def _states(snap: dict) -> tuple:
    return snap["dataset_state"], snap["iter_state"]


def _same(a: Any, b: Any) -> bool:
    """Whether two states are equal (by value; by their pickles where ``==`` is not a plain bool, as
    for arrays and tensors; a state that cannot be pickled counts as moved)."""
    try:
        eq = a == b
        if isinstance(eq, bool):
            return eq
    except Exception:  # noqa: BLE001 - an array's ambiguous truth value, a type that refuses ==
        pass
    try:
        return pickle.dumps(a) == pickle.dumps(b)
    except Exception:  # noqa: BLE001 - not picklable: trusted, as a user's resume is
        return False


def _take(it: Iterator, n: int) -> list:
    """Up to ``n`` items of ``it`` by ``next()`` alone, as torch's fetcher takes them: never
    ``iter(it)`` again (``itertools.islice`` would call it, and a dataset that is its own
    iterator and sets its position up in ``__iter__`` would start over)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def first_snapshot(dataset: Any, it: Iterator, samples: int, batches: int = 0) -> dict:
    """The snapshot of a shard just opened (:func:`open_shard`), before its first batch."""
    return _snapshot(dataset, it, samples, batches)


def iterate_shard(dataset: Any, batch_size: Optional[int], drop_last: bool, collate: Callable[[Any], Any],
                  resume: Optional[dict] = None, opened: Optional[tuple[Iterator, int]] = None
                  ) -> Iterator[tuple[Any, int, dict]]:
    """A shard's batches as ``(batch, samples in it, snapshot after it)``; the last snapshot has
    ``ended`` and the dataset's state once exhausted (``end_state``). ``opened``: the shard's
    :func:`open_shard` already (``iter()`` called when the epoch began, as torch does in-process)."""
    if resume and resume.get("ended"):
        return
    it, samples = opened if opened is not None else open_shard(dataset, resume)
    batches = batches_before(resume)
    pending: Optional[tuple[Any, int, dict]] = None
    # ``tracks``: None until two batches of one ``iter()`` were compared (a generator's ``__iter__`` runs at
    # its first ``next()``, so the state before the first batch says nothing); False once it stood still
    chain = {"origin": chain_origin(resume), "tracks": (resume or {}).get("tracks") if "origin" in (resume or {})
             else None}
    before: Optional[tuple] = None
    while True:
        if batch_size is None:
            try:
                chunk: Any = next(it)
            except StopIteration:
                break
            n = 1
        else:
            chunk = _take(it, batch_size)
            n = len(chunk)
            if not chunk or (drop_last and n < batch_size):
                break
        samples += n
        batches += 1
        batch = collate(chunk)
        if pending is not None:
            yield pending
        snap = _snapshot(dataset, it, samples, batches)
        after = _states(snap)
        if before is not None and chain["tracks"] is not False:  # a state that stood still holds no position
            chain["tracks"] = not _same(before, after)
        before = after
        snap.update(chain)
        pending = (batch, n, snap)
    if pending is not None:
        snap = pending[2]
        snap["ended"] = True
        snap["end_state"] = copy.deepcopy(dataset.state_dict()) if is_stateful(dataset) else None
        yield pending


@dataclass
class IterableRun:
    """One epoch of an ``IterableDataset`` in the trainer: per shard, the snapshot of the last batch taken.

    Attributes:
        epoch: the epoch number.
        epoch_seed: the epoch seed (each shard's RNGs derive from it).
        resume: per shard, the snapshot the epoch resumed from (empty: a fresh epoch).
        taken: per shard, the snapshot of the last batch the loop took.
        complete: the epoch ran to its end.
    """

    epoch: int
    epoch_seed: int
    resume: dict = field(default_factory=dict)
    taken: dict = field(default_factory=dict)
    complete: bool = False

    def took(self, record: tuple) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the loop took a batch of shard ``record[0]``."""
        shard, snap = record
        self.taken[int(shard)] = snap

    def finished(self) -> None:
        """(:class:`~sbloader.loaders.epoch.Run`) the epoch ran to its end."""
        self.complete = True

    def shard_resume(self, shard: int) -> Optional[dict]:
        """Where shard ``shard`` resumes (None: from its start)."""
        return self.resume.get(shard)

    def shards(self) -> dict:
        """Every shard's latest snapshot: taken in this run, else the one it resumed from."""
        return {**self.resume, **self.taken}

    def state(self) -> dict:
        """The run's part of the loader's state (JSON-serialisable when the datasets' states are)."""
        if self.complete:  # the next epoch starts fresh, from the datasets' states at their end
            ends = {str(w): {"samples": 0, "dataset_state": s.get("end_state"), "iter_state": None, "ended": False}
                    for w, s in self.shards().items() if s.get("end_state") is not None}
            return {"epoch": self.epoch + 1, "epoch_seed": None, "shards": ends}
        return {"epoch": self.epoch, "epoch_seed": self.epoch_seed,
                "shards": {str(w): public_snapshot(s) for w, s in self.shards().items()}}


def run_from_state(state: dict, next_epoch: Callable[[], tuple[int, int]]) -> IterableRun:
    """The run a loaded state resumes (the next fresh epoch when it has no seed)."""
    resume = {int(w): s for w, s in (state.get("shards") or {}).items()}
    if state.get("epoch_seed") is None:
        epoch, seed = next_epoch()
        return IterableRun(epoch, seed, resume)
    return IterableRun(int(state["epoch"]), int(state["epoch_seed"]), resume)
