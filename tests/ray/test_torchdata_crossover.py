"""Checkpoints cross over between torchdata's ``StatefulDataLoader`` and ``sbloader.DataLoader`` (issue #45).

A state written by torchdata's real ``StatefulDataLoader`` (0.11) loads into
``sbloader.DataLoader`` over the same dataset and ``num_workers`` and resumes exactly
once, with the remaining batches StatefulDataLoader's own resume gives; sbloader's
states show StatefulDataLoader's layout (``_snapshot``, ``_worker_snapshots``,
``worker_N``, ``fetcher_state``, ``dataset_state`` ...) beside its own ledger.
Everything the workers use is defined at module level (conftest puts tests/ on their path).
"""
from __future__ import annotations

import io
import itertools
import json
import warnings

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader  # the test extra (torchdata>=0.11)

import sbloader
from sbloader.core.errors import StateDictError

N, BS = 50, 4
SIZES = [23, 17]  # per worker (an IterableDataset's shards); one shard of 40 with no workers


def saved(state: dict) -> dict:
    """``state`` through ``torch.save`` / ``torch.load``, as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class Numbers(Dataset):
    """``0..n-1``, map-style."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Positioned(IterableDataset):
    """Worker ``w`` yields its shard of ``sizes``; the dataset's own state is its position."""

    def __init__(self, sizes=SIZES):
        self.sizes, self.i, self.resume = sizes, 0, None

    def _shard(self):
        info = get_worker_info()
        sizes = self.sizes if info else [sum(self.sizes)]
        w = info.id if info else 0
        return sum(sizes[:w]), sizes[w]

    def __iter__(self):
        start, size = self._shard()
        self.i, self.resume = (self.resume or 0), None
        while self.i < size:
            self.i += 1
            yield start + self.i - 1

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.resume = state["i"]


def shards(num_workers: int) -> list:
    """The samples of each worker shard of :class:`Positioned`."""
    sizes = SIZES if num_workers else [sum(SIZES)]
    return [set(range(sum(sizes[:w]), sum(sizes[:w + 1]))) for w in range(len(sizes))]


def flat(batches) -> list:
    return [int(x) for b in batches for x in (b.tolist() if hasattr(b, "tolist") else b)]


def torchdata_map(nw: int, shuffle: bool, every: int = 1, seed: int = 7):
    gen = torch.Generator().manual_seed(seed) if shuffle else None
    return StatefulDataLoader(Numbers(), batch_size=BS, shuffle=shuffle, generator=gen, num_workers=nw,
                              snapshot_every_n_steps=every)


def sbloader_map(nw: int, shuffle: bool):
    # another seed than the state's: the order comes from the state
    gen = torch.Generator().manual_seed(12345) if shuffle else None
    return sbloader.DataLoader(Numbers(), batch_size=BS, shuffle=shuffle, generator=gen, num_workers=nw)


def take(loader, k: int):
    it = iter(loader)
    return it, [next(it) for _ in range(k)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_state_of_statefuldataloader_resumes_its_order_exactly_once(ray_session, num_workers):
    for shuffle, every, k in ((True, 1, 5), (False, 1, 3), (True, 3, 5), (True, 1, 0)):
        src = torchdata_map(num_workers, shuffle, every)
        _, first = take(src, k)
        state = saved(src.state_dict())
        reference = torchdata_map(num_workers, shuffle, every, seed=99)
        reference.load_state_dict(state)
        expected = flat(reference)
        dl = sbloader_map(num_workers, shuffle)
        dl.load_state_dict(state)
        rest = flat(dl)
        case = (shuffle, every, k)
        assert rest == expected, case
        assert sorted(flat(first) + rest) == list(range(N)), case  # every sample once across the two runs
        assert len(flat(dl)) == N, case  # then the next epoch, whole


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_state_of_statefuldataloader_resumes_exactly_once(ray_session, num_workers):
    total = sum(SIZES)
    for k in (3, 0):
        src = StatefulDataLoader(Positioned(), batch_size=BS, num_workers=num_workers)
        _, first = take(src, k)
        state = saved(src.state_dict())
        reference = StatefulDataLoader(Positioned(), batch_size=BS, num_workers=num_workers)
        reference.load_state_dict(state)
        expected = flat(reference)
        dl = sbloader.DataLoader(Positioned(), batch_size=BS, num_workers=num_workers)
        dl.load_state_dict(state)
        rest = flat(dl)
        assert sorted(flat(first) + rest) == list(range(total)), k  # every sample once across the two runs
        assert rest == expected, k  # each shard goes on, dealt round-robin from where the state left it


def test_iterable_state_of_another_num_workers_is_refused_with_the_reason():
    src = StatefulDataLoader(Positioned(), batch_size=BS, num_workers=0)
    take(src, 2)
    dl = sbloader.DataLoader(Positioned(), batch_size=BS, num_workers=2)
    with pytest.raises(StateDictError, match="num_workers=0.*num_workers=2.*same num_workers"):
        dl.load_state_dict(src.state_dict())


def test_map_state_of_a_shuffled_statefuldataloader_is_refused_by_an_unshuffled_loader():
    src = torchdata_map(0, shuffle=True)
    take(src, 2)
    dl = sbloader_map(0, shuffle=False)
    with pytest.raises(StateDictError, match="shuffled epoch.*shuffle=True"):
        dl.load_state_dict(src.state_dict())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_shows_statefuldataloader_layout_beside_the_ledger(ray_session, num_workers):
    k = 3
    dl = sbloader.DataLoader(Positioned(), batch_size=BS, num_workers=num_workers)
    it, first = take(dl, k)
    state = json.loads(json.dumps(dl.state_dict()))  # still plain JSON
    if num_workers == 0:
        assert state["_num_yielded"] == k
        assert state["dataset_state"] == {"i": k * BS}
        assert state["fetcher_state"] == {"dataset_iter_state": None, "fetcher_ended": False}
    else:
        snap = state["_snapshot"]
        assert snap["_snapshot_step"] == k and state["_steps_since_snapshot"] == 0
        assert snap["_main_snapshot"]["_num_workers"] == num_workers
        assert sorted(snap["_worker_snapshots"]) == [f"worker_{w}" for w in range(num_workers)]
        # each worker's dataset state is its shard's position after the batches of it the loop took
        made = [sum(1 for x in flat(first) if x in shard) for shard in shards(num_workers)]
        for w, count in enumerate(made):
            ws = snap["_worker_snapshots"][f"worker_{w}"]
            assert ws["worker_id"] == w and ws["fetcher_state"]["fetcher_ended"] is False
            assert (ws["dataset_state"] or {"i": 0})["i"] == count, (w, made)
    assert state["_iterator_finished"] is False
    assert "iterable" in state and state["format"] == "sbloader.DataLoader"  # sbloader's own, beside it
    rest = flat(it)
    again = sbloader.DataLoader(Positioned(), batch_size=BS, num_workers=num_workers)
    again.load_state_dict(state)
    assert flat(again) == rest  # sbloader's own resume is unchanged

    m = sbloader_map(num_workers, shuffle=True)
    _, first = take(m, k)
    mstate = json.loads(json.dumps(m.state_dict()))
    step = mstate["_num_yielded"] if num_workers == 0 else mstate["_snapshot"]["_snapshot_step"]
    assert step == k and mstate["consumed"] == [[0, k * BS]]


def ident(batch):
    return batch


class Drawing(Dataset):
    """Sample ``i`` with a draw from the worker's torch RNG (seeded per epoch, as torch's workers)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return (i, int(torch.randint(1000, (1,))))


class DrawingShards(IterableDataset):
    """Worker ``w``'s shard of ``SIZES``, each sample with a draw from the worker's torch RNG."""

    def __iter__(self):
        info = get_worker_info()
        sizes = SIZES if info else [sum(SIZES)]
        w = info.id if info else 0
        for x in range(sum(sizes[:w]), sum(sizes[:w + 1])):
            yield (x, int(torch.randint(1000, (1,))))


@pytest.mark.parametrize("persistent", [False, True])
def test_state_after_the_epoch_resumes_the_next_epoch_as_statefuldataloader(ray_session, persistent):
    """torchdata's TestSnapshotEnd: a state taken once the epoch ended, loaded into a new loader whose
    generator is seeded again, gives the very batches the first loader's next epoch gives."""
    for make in (Drawing, DrawingShards):
        g = torch.Generator().manual_seed(4)
        dl = sbloader.DataLoader(make(), batch_size=BS, num_workers=2, generator=g, persistent_workers=persistent,
                                 collate_fn=ident)
        list(dl)
        state = saved(dl.state_dict())
        expected = list(dl)
        del dl  # let go, as a resuming script lets the loader it checkpointed go: again takes its (persistent)
        # workers from the idle pool instead of starting 2 of its own beside them
        g.manual_seed(4)
        again = sbloader.DataLoader(make(), batch_size=BS, num_workers=2, generator=g,
                                    persistent_workers=persistent, collate_fn=ident)
        again.load_state_dict(state)
        assert list(again) == expected, make.__name__
        n = len(Drawing()) if make is Drawing else sum(SIZES)
        assert sorted(x for b in expected for x, _ in b) == list(range(n)), make.__name__
        del again  # the next dataset's loader takes its workers


@pytest.mark.parametrize("num_workers", [0, 2])
def test_statefuldataloader_state_at_the_epoch_end_resumes_as_statefuldataloader(ray_session, num_workers):
    """A StatefulDataLoader state taken after the epoch's last batch inside the loop resumes an empty
    remainder, then the next epoch; one taken after the loop ended, the next epoch, as its own resume."""
    batches = -(-N // BS)
    for ended in (False, True):
        src = torchdata_map(num_workers, shuffle=True)
        it, _ = take(src, batches)
        if ended:
            assert list(it) == []
        state = saved(src.state_dict())
        reference = torchdata_map(num_workers, shuffle=True, seed=99)
        reference.load_state_dict(state)
        expected_first = flat(reference)
        dl = sbloader_map(num_workers, shuffle=True)
        dl.load_state_dict(state)
        first = flat(dl)
        if not ended:  # the empty remainder, as StatefulDataLoader's own resume, then the next epoch
            assert first == expected_first == []
            first = flat(dl)
        # the next epoch, whole (its order is drawn by sbloader's sampler: the user guide says how)
        assert sorted(first) == sorted(expected_first if ended else first) == list(range(N)), ended


def _shuffled(num_workers: int, persistent: bool = False, seed=None):
    return sbloader.DataLoader(Numbers(), batch_size=BS, shuffle=True, num_workers=num_workers,
                               persistent_workers=persistent, seed=seed)


def test_state_before_iterating_fixes_the_epoch_in_process():
    """torchdata's TestInitialState::test_load_then_state, no workers: a state taken before the loader
    iterated (StatefulDataLoader's state_dict() creates its iterator: the order is drawn then) is the
    epoch the loader then plays, and a loader that loads it, mid-epoch of its own, plays it again."""
    dl = _shuffled(0)
    state0 = saved(dl.state_dict())
    assert state0["_num_yielded"] == 0 and state0["consumed"] == []
    expected = flat(dl)
    assert sorted(expected) == list(range(N))
    other = _shuffled(0)
    take(other, 3)
    other.load_state_dict(state0)
    assert other.state_dict() == state0
    assert flat(other) == expected

    # set_epoch after such a state: the drawn epoch goes quietly (it was never loaded)
    fresh = _shuffled(0, seed=5)
    fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.set_epoch(2)
    reference = _shuffled(0, seed=5)
    reference.set_epoch(2)
    assert flat(fresh) == flat(reference)


@pytest.mark.parametrize("persistent", [False, True])
def test_state_before_iterating_fixes_the_epoch_with_workers(ray_session, persistent):
    """The same with 4 workers (TestInitialState::test_load_then_state's loaders)."""
    dl = _shuffled(4, persistent)
    state0 = saved(dl.state_dict())
    assert state0["_snapshot"]["_snapshot_step"] == 0
    expected = flat(dl)
    del dl  # dropped: its (persistent) workers wait in the idle pool, and other's pool takes them, rebuilt,
    # instead of starting 4 processes of its own beside them (~6 s on 2 cores)
    other = _shuffled(4, persistent)
    take(other, 3)
    other.load_state_dict(state0)
    assert other.state_dict() == state0
    assert flat(other) == expected


class CountsIters(IterableDataset):
    """Worker ``w``'s half of ``0..19``; its own state counts its ``__iter__`` calls (torchdata's CountIterCalls)."""

    def __init__(self):
        self.iter_calls = 0

    def __iter__(self):
        self.iter_calls += 1
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(w * 20 // n, (w + 1) * 20 // n))

    def state_dict(self):
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state):
        pass


def test_state_before_a_workers_first_batch_shows_its_state_after_iter(ray_session):
    """torchdata's TestSingleIterCalled::test_mp: each worker's state, before any of its batches, is its
    dataset's right after ``iter()`` (one call per worker), and so after a resume; the trainer's
    dataset and RNG are left as they were."""
    dl = sbloader.DataLoader(CountsIters(), num_workers=2)
    rng = torch.get_rng_state()
    fresh = dl.state_dict()
    assert torch.equal(torch.get_rng_state(), rng)
    it = iter(dl)
    rng = torch.get_rng_state()
    state = dl.state_dict()
    assert torch.equal(torch.get_rng_state(), rng)
    for s in (fresh, state):
        workers = s["_snapshot"]["_worker_snapshots"]
        assert [workers[f"worker_{w}"]["dataset_state"] for w in range(2)] == [{"iter_calls": 1}] * 2
    assert dl.dataset.iter_calls == 0
    again = sbloader.DataLoader(CountsIters(), num_workers=2)
    again.load_state_dict(state)
    iter(again)
    workers = again.state_dict()["_snapshot"]["_worker_snapshots"]
    assert [workers[f"worker_{w}"]["dataset_state"] for w in range(2)] == [{"iter_calls": 1}] * 2
    assert sorted(flat(it)) == list(range(20))  # the loader itself is unchanged


class SetsUpInIter(IterableDataset):
    """Its own iterator, its position set up by ``__iter__`` (torchdata's CountIterCallsIter): worker
    ``w`` of ``n`` yields its ``1/n`` of ``0..length-1``; its state is its position."""

    def __init__(self, length: int = 40):
        self.length = length

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        self.pos, self.end = w * self.length // n, (w + 1) * self.length // n
        return self

    def __next__(self):
        if self.pos >= self.end:
            raise StopIteration
        self.pos += 1
        return self.pos - 1

    def state_dict(self):
        return {"pos": self.pos, "end": self.end}

    def load_state_dict(self, state):
        self.pos, self.end = state["pos"], state["end"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_sets_up_in_iter_is_iterated_once_and_resumes(ray_session, num_workers):
    """torchdata's TestStateInitializationDataset: ``iter()`` is called once per shard (a batch is
    taken by ``next()``, never by ``iter()`` again), so a dataset that sets up its position in
    ``__iter__`` is read through, and a resume from its state gives the rest, exactly once."""
    dl = sbloader.DataLoader(SetsUpInIter(), batch_size=3, num_workers=num_workers)
    it, first = take(dl, 5)
    state = saved(dl.state_dict())
    again = sbloader.DataLoader(SetsUpInIter(), batch_size=3, num_workers=num_workers)
    again.load_state_dict(state)
    bounded = lambda batches: flat(itertools.islice(batches, 20))  # noqa: E731 (14 at most: a loop fails, never hangs)
    assert sorted(flat(first) + bounded(again)) == list(range(40))
    assert sorted(flat(first) + bounded(it)) == list(range(40))
