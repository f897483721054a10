"""``DataLoader.state_dict`` / ``load_state_dict`` in one process (world size 1).

Every resume goes through JSON (``json.loads(json.dumps(state))``) into a *new*
loader, as a checkpoint file would. The dataset's samples carry their id and a
random augmentation drawn from torch's, NumPy's and Python's global RNGs, so a
replayed batch can be compared bit for bit with an uninterrupted run's.

With ``num_workers=0`` and no ``seed=``, sbloader leaves the trainer's global RNGs
as torch does (it never seeds them), so augmentations drawn there cannot replay;
those cases compare the sample ids only. Everywhere else (``seed=``, or remote
workers, which are seeded per batch from the epoch seed in the state) the
augmentations must be identical.
"""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, Sampler, SequentialSampler

import sbloader
from sbloader import StateDictError
from sbloader.core import ledger

N = 64
BS = 4
K = 5  # batches taken before the state is saved


class AugIds(Dataset):
    """Sample i: its id and three draws from the global RNGs (an augmentation)."""

    def __init__(self, n: int = N, slow: tuple = (), delay: float = 0.0) -> None:
        self.n, self.slow, self.delay = n, frozenset(slow), delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i in self.slow:
            time.sleep(self.delay)
        aug = torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)
        return {"id": i, "aug": aug}


class Ints(Dataset):
    """A cheap dataset of a million ints."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


class EveryOther(Sampler):
    """A custom sampler: even indices, then odd ones."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(list(range(0, self.n, 2)) + list(range(1, self.n, 2)))


def make(num_workers: int = 0, in_order: bool = True, mode: str = "seed", gen_seed: int = 1234,
         dataset: Dataset = None, **kw) -> sbloader.DataLoader:
    """``mode``: "gen" shuffles with a seeded generator, "seed" with ``seed=``, "none" not at all."""
    if mode == "gen":
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(gen_seed))
    elif mode == "seed":
        kw.update(shuffle=True, seed=99)
    kw.setdefault("batch_size", BS)
    kw.setdefault("dataset_id", "aug")
    if num_workers:
        kw.setdefault("persistent_workers", True)  # one pool per loader, not per epoch
    loader = sbloader.DataLoader(dataset if dataset is not None else AugIds(), num_workers=num_workers,
                                 in_order=in_order, **kw)
    _LOADERS.append(loader)
    return loader


_LOADERS: list = []


@pytest.fixture(autouse=True)
def _release_workers():
    """Kill every persistent pool a test made, even when it failed (a pool holds CPUs)."""
    yield
    while _LOADERS:
        drop(_LOADERS[-1])  # its actors go to the idle pool, killed by the conftest's release_idle


def drop(loader) -> None:
    """``loader`` let go now, as a script lets its interrupted loader go before it builds the resumed one:
    its persistent actors wait in the process's idle pool, where the next loader of the same shape takes
    them (kept in ``_LOADERS`` to the test's end, each loader of a test started actors of its own)."""
    _LOADERS.remove(loader)
    loader.__del__()


def via_json(state: dict) -> dict:
    text = json.dumps(state)  # raises on anything that is not plain JSON
    back = json.loads(text)
    assert back == state, "the state holds non-JSON values (tuples, NumPy scalars...)"
    return back


def ids_of(batches) -> list:
    return [i for b in batches for i in b["id"].tolist()]


def aug_of(batches) -> dict:
    return {i: a.tolist() for b in batches for i, a in zip(b["id"].tolist(), b["aug"])}


def take(loader, k: int, then_drop: bool = False):
    """The first ``k`` batches, the state after them, then the iterator is dropped (and the loader:
    ``then_drop``)."""
    it = iter(loader)
    first = [next(it) for _ in range(k)]
    state = loader.state_dict()
    it.close()
    if then_drop:
        drop(loader)
    return first, state


def check_once(ids: list, n: int = N) -> None:
    dup = sorted({i for i in ids if ids.count(i) > 1})
    lost = sorted(set(range(n)) - set(ids))
    assert not dup and not lost and len(ids) == n, f"duplicated {dup}, lost {lost}"


_REFS: dict = {}


def reference(num_workers: int, mode: str):
    """An uninterrupted epoch 0 (and epoch 1) of a fresh loader (cached per module)."""
    key = (num_workers, mode)
    if key not in _REFS:
        loader = make(num_workers, True, mode)
        _REFS[key] = (list(loader), list(loader))
        drop(loader)
    return _REFS[key]


def positions_of(state: dict, order: list) -> set:
    """Dataset ids at the ledger's positions of an epoch's order."""
    return {order[p] for p in ledger.to_positions(state["consumed"]).tolist()}


# ----- resume mid-epoch ----------------------------------------------------------------

CASES = [(nw, io, mode) for nw in (0, 2) for io in (True, False) for mode in ("gen", "seed")]


@pytest.mark.parametrize("num_workers,in_order,mode", CASES, ids=[f"w{a}-{'ordered' if b else 'unordered'}-{c}"
                                                                     for a, b, c in CASES])
def test_resume_mid_epoch_replays_exactly_the_rest(ray_session, num_workers, in_order, mode):
    ref0, _ = reference(0, mode)
    ref = reference(num_workers, mode)[0] if (mode == "gen" and num_workers) else ref0
    order = ids_of(ref0)

    first, state = take(make(num_workers, in_order, mode), K, then_drop=True)
    state = via_json(state)
    assert state["epoch"] == 0 and state["format"] == "sbloader.DataLoader" and state["version"] == 1
    # the ledger holds exactly what the loop received, not what was prefetched
    assert ledger.count(state["consumed"]) == K * BS
    assert positions_of(state, order) == set(ids_of(first))

    # a new loader, another generator: the order comes from the state
    resumed = make(num_workers, in_order, mode, gen_seed=777)
    resumed.load_state_dict(state)
    rest = list(resumed)
    check_once(ids_of(first + rest))
    assert len(first) + len(rest) == N // BS
    if in_order:
        assert ids_of(first + rest) == order
        for got, want in zip(first + rest, ref):
            assert torch.equal(got["id"], want["id"])
            if num_workers or mode == "seed":
                assert torch.equal(got["aug"], want["aug"]), "a replayed batch drew other numbers"
    elif num_workers or mode == "seed":
        assert aug_of(first + rest) == aug_of(ref)
    # the same loader carries on into the next epoch as the uninterrupted one does (with a generator
    # too: the state puts the user's generator where the epoch's draws left it)
    nxt = list(resumed)
    check_once(ids_of(nxt))
    ref1 = (reference(num_workers, mode) if mode == "gen" else reference(0, mode))[1]
    if in_order or not num_workers:
        assert ids_of(nxt) == ids_of(ref1)
    if num_workers or mode == "seed":
        assert aug_of(nxt) == aug_of(ref1)  # per id: seeded by its batch, so the same order too


def test_seeded_augmentations_do_not_depend_on_num_workers(ray_session):
    assert aug_of(reference(0, "seed")[0]) == aug_of(list(make(2, False, "seed")))


def test_unordered_resume_from_a_ledger_with_gaps_twice(ray_session):
    """Batch 0 is slow: later batches overtake it, so the ledger is not a prefix; resume twice.

    Epoch 0 warms the pool up (a cold pool's first actor takes the first batches in
    order); the checkpoints are taken in epoch 1.
    """
    order = ids_of(reference(0, "seed")[1])
    slow = dict(dataset=AugIds(slow=order[:BS], delay=0.5))
    loader = make(2, False, "seed", **slow)
    list(loader)
    first, s1 = take(loader, K, then_drop=True)
    s1 = via_json(s1)
    assert s1["epoch"] == 1
    assert len(s1["consumed"]) >= 2 or s1["consumed"][0][0] > 0, f"no out-of-order delivery: {s1['consumed']}"
    assert positions_of(s1, order) == set(ids_of(first))

    second_loader = make(2, False, "seed", **slow)
    second_loader.load_state_dict(s1)
    second, s2 = take(second_loader, 4, then_drop=True)
    s2 = via_json(s2)
    assert ledger.count(s2["consumed"]) == (K + 4) * BS
    assert positions_of(s2, order) == set(ids_of(first + second))

    third = make(2, False, "seed")
    third.load_state_dict(s2)
    rest = list(third)
    check_once(ids_of(first + second + rest))
    assert aug_of(first + second + rest) == aug_of(reference(0, "seed")[1])


def test_sequential_custom_and_distributed_samplers_resume(ray_session):
    from torch.utils.data import DistributedSampler

    for kw in (dict(mode="none"), dict(mode="none", sampler=EveryOther(N)),
               dict(mode="none", sampler=DistributedSampler(AugIds(), num_replicas=1, rank=0, seed=3))):
        ref = list(make(**kw))
        first, state = take(make(**kw), K, then_drop=True)
        kw2 = dict(kw)
        if "sampler" in kw2:  # a fresh sampler object of the same kind
            kw2["sampler"] = (EveryOther(N) if isinstance(kw["sampler"], EveryOther)
                              else DistributedSampler(AugIds(), num_replicas=1, rank=0, seed=3))
        resumed = make(**kw2)
        resumed.load_state_dict(via_json(state))
        assert ids_of(first + list(resumed)) == ids_of(ref), kw


# ----- a million samples: the state stays small ------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_million_sample_state_is_small(ray_session, num_workers):
    n = 1_000_000
    kw = dict(dataset=Ints(n), batch_size=1000, dataset_id="ints")
    a = make(num_workers, False, "gen", **kw)
    first, s1 = take(a, 3, then_drop=True)
    text = json.dumps(s1)
    assert len(text) <= 64 * 1024, len(text)
    taken = {int(i) for b in first for i in b}
    assert len(taken) == 3000

    b = make(0, True, "gen", gen_seed=5, **kw)  # resumed mid-way, in-process this time
    b.load_state_dict(json.loads(text))
    second, s2 = take(b, 3)
    text2 = json.dumps(s2)
    assert len(text2) <= 64 * 1024, len(text2)
    again = {int(i) for bt in second for i in bt}
    assert len(again) == 3000 and not (again & taken), "a resumed epoch repeated consumed samples"
    assert ledger.count(s2["consumed"]) == 6000
    assert s2["epoch_seed"] == s1["epoch_seed"] and s2["order"] == s1["order"]


# ----- validation ---------------------------------------------------------------------

def _mid_state(**kw) -> dict:
    return via_json(take(make(**kw), K)[1])


@pytest.mark.parametrize("change,message", [
    (dict(dataset=AugIds(60)), "state len: found 64, expected 60"),
    (dict(batch_size=8), "state batch_size: found 4, expected 8"),
    (dict(dataset_id="other"), "state dataset_id: found 'aug', expected 'other'"),
    (dict(mode="none"), "state sampler: found 'RandomSampler', expected 'SequentialSampler'"),
    (dict(drop_last=True), "state drop_last: found False, expected True"),
    (dict(dataset=Ints(N)), "state dataset: found 'AugIds', expected 'Ints'"),
])
def test_a_state_of_another_loader_is_refused(change, message):
    state = _mid_state()
    kw = dict(mode="seed")
    kw.update(change)
    loader = make(**kw)
    with pytest.raises(StateDictError, match=message.replace("(", r"\(")) as e:
        loader.load_state_dict(state)
    assert isinstance(e.value, ValueError) and "strict=False" in str(e.value)
    assert loader._resume is None  # a refused state is not half-applied


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.update(format="torch.DataLoader"), "state format: found 'torch.DataLoader', expected "
                                                    "'sbloader.DataLoader'"),
    (lambda s: s.update(version=2), "state version: found 2, expected 1"),
    (lambda s: s.pop("version"), "state version: found None, expected 1"),
    (lambda s: s.pop("consumed"), "the state has no 'consumed'"),
    (lambda s: s.pop("fingerprint"), "the state has no 'fingerprint'"),
])
def test_malformed_states_are_refused(edit, message):
    state = _mid_state()
    edit(state)
    with pytest.raises(StateDictError, match=message):
        make().load_state_dict(state)
    with pytest.raises(StateDictError, match=message):
        make().load_state_dict(state, strict=False)  # strict=False only skips the fingerprint
    with pytest.raises(StateDictError, match="a DataLoader state is a dict, found list"):
        make().load_state_dict([state])


def test_unknown_order_kind_is_named_on_iteration():
    state = _mid_state()
    state["order"]["kind"] = "bogus"
    loader = make()
    loader.load_state_dict(state)
    with pytest.raises(StateDictError, match="unknown sampler-order kind 'bogus'"):
        next(iter(loader))


def test_strict_false_loads_a_state_of_another_dataset_id_or_batch_size():
    first, state = take(make(), K)
    renamed = make(dataset_id="renamed")
    renamed.load_state_dict(state, strict=False)
    assert ids_of(first + list(renamed)) == ids_of(reference(0, "seed")[0])
    # another batch size: the rest is cut into batches of 8, still each sample once
    bigger = make(batch_size=8)
    bigger.load_state_dict(state, strict=False)
    rest = list(bigger)
    assert [len(b["id"]) for b in rest] == [8] * ((N - K * BS) // 8) + ([4] if (N - K * BS) % 8 else [])
    check_once(ids_of(first + rest))
    # a longer epoch's ledger into a shorter dataset: positions past the end are ignored
    longer = dict(state, consumed=[[0, 4], [70, 90]])
    short = make()
    short.load_state_dict(longer, strict=False)
    rest = ids_of(list(short))
    assert sorted(rest + ids_of(first[:1])) == list(range(N))


# ----- epoch boundaries -------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_at_the_end_of_an_epoch_starts_the_next_one(ray_session, num_workers):
    ref0, ref1 = reference(0, "seed")
    loader = make(num_workers, True, "seed")
    it = iter(loader)
    batches = [next(it) for _ in range(N // BS)]
    at_last_batch = via_json(loader.state_dict())  # the last batch received, the iterator not exhausted
    assert list(it) == []
    exhausted = via_json(loader.state_dict())
    # StatefulDataLoader's contract: inside the loop, an empty remainder of epoch 0; after it, epoch 1
    assert at_last_batch["epoch"] == 0 and at_last_batch["empty_remainder"], at_last_batch
    assert exhausted["epoch"] == 1 and exhausted["consumed"] == [] and exhausted["epoch_seed"] is None, exhausted
    assert ids_of(batches) == ids_of(ref0)
    del it
    drop(loader)

    nxt = make(num_workers, True, "seed")
    nxt.load_state_dict(at_last_batch)
    assert list(nxt) == []  # the rest of epoch 0: nothing
    first, mid = take(nxt, 2)
    assert mid["epoch"] == 1 and ledger.count(mid["consumed"]) == 2 * BS
    nxt.load_state_dict(exhausted)
    epoch1 = list(nxt)  # a full new epoch: epoch 1, bit for bit
    assert len(epoch1) == N // BS
    assert ids_of(epoch1) == ids_of(ref1) and ids_of(first) == ids_of(ref1[:2])
    assert all(torch.equal(a["aug"], b["aug"]) for a, b in zip(epoch1, ref1))
    assert nxt.state_dict()["epoch"] == 2


def test_state_at_the_end_of_an_epoch_with_a_generator():
    loader = make(mode="gen")
    list(loader)
    state = via_json(loader.state_dict())
    assert state["epoch"] == 1 and state["consumed"] == [] and state["generator"]
    nxt = make(mode="gen", gen_seed=3)  # another generator: the state's wins
    nxt.load_state_dict(state)
    epoch1 = list(nxt)
    assert ids_of(epoch1) == ids_of(reference(0, "gen")[1])
    assert nxt.state_dict()["epoch"] == 2
    with pytest.raises(StateDictError, match="generator state cannot be restored"):
        make(mode="gen").load_state_dict(dict(state, generator="AAAA"))


def test_state_before_iterating():
    fresh = make()
    state = via_json(fresh.state_dict())
    assert state["epoch"] == 0 and state["consumed"] == []
    loaded = make()
    loaded.load_state_dict(state)
    assert loaded.state_dict() == state  # loaded, not iterated: the same state again
    assert ids_of(list(loaded)) == ids_of(reference(0, "seed")[0])

    # a resumed mid-epoch state survives a checkpoint taken before iterating
    first, mid = take(make(), K)
    loaded = make()
    loaded.load_state_dict(mid)
    again = via_json(loaded.state_dict())
    assert again == mid
    relay = make()
    relay.load_state_dict(again)
    assert ids_of(first + list(relay)) == ids_of(reference(0, "seed")[0])

    # after set_epoch: the state names that epoch, and a new loader plays it
    third = make()
    third.set_epoch(3)
    s3 = via_json(third.state_dict())
    assert s3["epoch"] == 3
    other = make()
    other.load_state_dict(s3)
    ref3 = make()
    ref3.set_epoch(3)
    assert ids_of(list(other)) == ids_of(list(ref3))


# ----- what cannot be checkpointed ------------------------------------------------------

def test_state_dict_refuses_what_it_cannot_replay():
    iterable = sbloader.DataLoader(Stream(), batch_size=2)
    custom = sbloader.DataLoader(AugIds(), batch_sampler=BatchSampler(SequentialSampler(range(N)), 4, False))
    unbatched = sbloader.DataLoader(AugIds(), batch_size=None)
    # an IterableDataset and batch_size=None resume (tests/ray/test_stateful_contract.py)
    iterable.load_state_dict(iterable.state_dict())
    unbatched.load_state_dict(unbatched.state_dict())
    for loader, what in ((custom, "batch_sampler"),):
        with pytest.raises(StateDictError, match=what):
            loader.state_dict()
        list(loader)  # iterating changes nothing
        with pytest.raises(StateDictError, match=what):
            loader.state_dict()
        with pytest.raises(StateDictError, match="map-style dataset batched by the loader itself"):
            loader.load_state_dict(_mid_state())


class BigCustom(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))


def test_a_big_custom_sampler_cannot_checkpoint_mid_epoch():
    loader = sbloader.DataLoader(Ints(10_000), batch_size=100, sampler=BigCustom(10_000))
    assert loader.state_dict()["consumed"] == []  # before iterating: nothing to recompute
    it = iter(loader)
    next(it)
    with pytest.raises(StateDictError, match="cannot checkpoint a BigCustom of 10000 positions"):
        loader.state_dict()
