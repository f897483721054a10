"""The mixture loader (sbloader/loaders/mix_loader.py) over fake source loaders, without Ray: resume
at every step of runs with weight changes, drops and restarts across a grid of batch sizes, each
source's epoch once, and the one-copy batch."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sbloader.core.errors import StateDictError
from sbloader.loaders.mix_loader import MixLoader

SIZES = {"a": 23, "b": 9, "c": 14}
OFFSET = {"a": 0, "b": 1000, "c": 2000}


class FakeLoader:
    """A deterministic source loader with the native loader's state rules: a state counts the
    batches the loop took; once every batch of an epoch was taken it names the next epoch."""

    def __init__(self, name: str, seed: int, batch_size: int) -> None:
        self.name, self.seed, self.batch_size = name, seed, batch_size
        self.epoch, self.k, self.live = 0, 0, False

    def _order(self, epoch: int) -> list:
        rng = np.random.default_rng([self.seed, epoch])
        return (OFFSET[self.name] + rng.permutation(SIZES[self.name])).tolist()

    def _batches(self) -> int:
        return -(-SIZES[self.name] // self.batch_size)

    def __iter__(self):
        if self.live:  # as the native loader: a new iteration without a loaded state is the next epoch
            self.epoch, self.k = self.epoch + 1, 0
        self.live = True
        order = self._order(self.epoch)
        while self.k < self._batches():
            lo = self.k * self.batch_size
            ids = order[lo:lo + self.batch_size]
            self.k += 1
            img = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(-1, 16, 16).contiguous()
            yield {"id": torch.tensor(ids), "sq": torch.tensor(ids) ** 2, "tag": [f"t{i}" for i in ids],
                   "img": img}  # 1 KiB rows: copied run by run
        self.epoch, self.k, self.live = self.epoch + 1, 0, False

    def state_dict(self) -> dict:
        if self.k >= self._batches():
            return {"epoch": self.epoch + 1, "k": 0}
        return {"epoch": self.epoch, "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.k, self.live = state["epoch"], state["k"], False


def _loader(batch_size=5, on_exhausted="restart", num_samples=None, weights=None, src_batch=None):
    names = ["a", "b", "c"]
    return MixLoader(names, lambda n, s: FakeLoader(n, s, src_batch or batch_size),
                     weights or {"a": 0.5, "b": 0.3, "c": 0.2}, seed=1, batch_size=batch_size,
                     on_exhausted=on_exhausted, num_samples=num_samples, source_key="src")


def _rows(batch) -> list:
    return list(zip(batch["src"].tolist(), batch["id"].tolist()))


def _script(loader, steps: int, changes: dict) -> list:
    """``steps`` batches of the loader (set_weights before the steps named in ``changes``)."""
    out, it = [], iter(loader)
    for step in range(steps):
        if step in changes:
            loader.set_weights(changes[step])
        try:
            out.append(_rows(next(it)))
        except StopIteration:
            break
    return out


CHANGES = {3: {"a": 0.0, "c": 0.7}, 7: {"b": 0.0}, 9: {"a": 1.0, "b": 0.2}}


@pytest.mark.parametrize("batch_size,src_batch", [(5, 5), (4, 7), (8, 3), (1, 2)])
@pytest.mark.parametrize("on_exhausted,num_samples", [("restart", 90), ("drop", None), ("stop", None)])
def test_resume_at_every_step_with_weight_changes(batch_size, src_batch, on_exhausted, num_samples):
    changes = CHANGES if on_exhausted == "restart" else {}
    steps = 200
    whole = _script(_loader(batch_size, on_exhausted, num_samples, src_batch=src_batch), steps, changes)
    assert whole
    for k in range(len(whole)):
        first = _loader(batch_size, on_exhausted, num_samples, src_batch=src_batch)
        head = _script(first, k, changes)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = _loader(batch_size, on_exhausted, num_samples, src_batch=src_batch)
        resumed.load_state_dict(state)
        rest = _script(resumed, steps, {s - k: w for s, w in changes.items() if s >= k})
        assert head + rest == whole, f"resumed after {k} batches"


@pytest.mark.parametrize("batch_size", [1, 4, 9])
def test_each_source_epoch_once_across_weight_changes(batch_size):
    rows = [r for b in _script(_loader(batch_size, num_samples=300), 400, CHANGES) for r in b]
    for j, n in enumerate(["a", "b", "c"]):
        ids = [i for s, i in rows if s == j]
        for lo in range(0, len(ids), SIZES[n]):
            chunk = ids[lo:lo + SIZES[n]]
            assert len(set(chunk)) == len(chunk)
            if len(chunk) == SIZES[n]:
                assert sorted(chunk) == list(range(OFFSET[n], OFFSET[n] + SIZES[n]))


def test_drop_reads_every_source_once_and_records_the_drops():
    loader = _loader(4, "drop")
    rows = [r for b in _script(loader, 100, {}) for r in b]
    assert len(rows) == sum(SIZES.values())
    assert sorted(i for _, i in rows) == sorted(OFFSET[n] + i for n in SIZES for i in range(SIZES[n]))
    assert [sorted(h[2]) for h in loader.history][-1] == ["a", "b", "c"]  # each drop recorded, the last ends it
    assert len(loader.history) == 4
    again = [r for b in _script(loader, 100, {}) for r in b]  # the next iteration: every source again
    assert sorted(i for _, i in again) == sorted(i for _, i in rows)


def test_the_batch_puts_every_column_in_schedule_order():
    loader = _loader(6, num_samples=60)
    for batch in loader:
        assert (batch["sq"] == batch["id"] ** 2).all()
        assert batch["img"].shape[1:] == (16, 16)
        assert (batch["img"] == batch["id"].float()[:, None, None]).all()
        assert batch["tag"] == [f"t{i}" for i in batch["id"].tolist()]
        assert ((batch["id"] // 1000) == batch["src"]).all()


def test_stats_and_len():
    loader = _loader(5, num_samples=100)
    assert len(loader) == 20
    list(loader)
    st = loader.stats()
    assert st.position == 100 and sum(s.taken for s in st.sources.values()) == 100
    assert st.sources["a"].weight == pytest.approx(0.5)
    assert st.sources["b"].epoch >= 2
    loader.set_weights({"a": 0.0})
    list(loader)
    st = loader.stats()
    assert st.since_change == 100 and st.sources["a"].share_since_change == 0.0
    assert "share" in str(st)
    with pytest.raises(TypeError, match="num_samples"):
        len(_loader(5))


def test_bad_states_are_refused_with_the_reason():
    state = _loader(5).state_dict()
    with pytest.raises(StateDictError, match="batch_size"):
        _loader(6).load_state_dict(state)
    broken = {**state, "history": [[3, {"a": 1, "b": 1, "c": 1}, []]]}
    with pytest.raises(StateDictError, match="first change"):
        _loader(5).load_state_dict(broken)
    broken = {**state, "sources": {"a": state["sources"]["a"]}}
    with pytest.raises(StateDictError, match="sources"):
        _loader(5).load_state_dict(broken)
    with pytest.raises(ValueError, match="on_exhausted"):
        _loader(5, "again")


def test_close_then_read_on_goes_on_where_it_was():
    whole = _script(_loader(5, num_samples=80), 100, {})
    loader = _loader(5, num_samples=80)
    it = iter(loader)
    head = [_rows(next(it)) for _ in range(5)]
    loader.close()  # every source's epoch stopped partway
    assert head + [_rows(b) for b in loader] == whole


def _world_loader(split: bool, world_size: int):
    """A mixture on ``world_size`` ranks of fake sources that count batches (no ``credit_rows``):
    split across ranks (cut anew for each world size) or, ``split=False``, iterated whole by every
    rank (as an ``IterableDataset``'s drop-in: the same batches on any world size)."""

    class Loader(FakeLoader):
        pass

    Loader.split = split
    loader = MixLoader(["a", "b", "c"], lambda n, s: Loader(n, s, 7), {"a": 0.5, "b": 0.3, "c": 0.2}, seed=1,
                       batch_size=5, on_exhausted="restart", num_samples=None, source_key="src")
    loader.world_size = world_size
    return loader


def test_on_another_world_size_a_split_source_that_counts_batches_is_refused_partway_and_lenient_warns():
    """A split source whose loader cannot credit rows cannot resume partway through a batch on
    another world size: refused, or with ``strict=False`` resumed with a warning that those rows
    come again. Between batches it loads anywhere."""
    loader = _world_loader(True, 2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["world_size"] == 2 and any(s["used"] for s in state["sources"].values())
    with pytest.raises(StateDictError, match="counts batches, not rows"):
        _world_loader(True, 1).load_state_dict(state)
    with pytest.warns(UserWarning, match="come again"):
        _world_loader(True, 1).load_state_dict(state, strict=False)
    between = {**state, "sources": {n: {**s, "used": 0} for n, s in state["sources"].items()}}
    _world_loader(True, 1).load_state_dict(between)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_on_another_world_size_a_source_every_rank_iterates_makes_its_batch_again_and_skips_the_used_rows(k):
    """A source every rank iterates whole (``split=False``) has the same batches on any world size:
    partway through one, its state resumes on another world size exactly as on the same one."""
    whole = _script(_world_loader(False, 2), 30, {})
    first = _world_loader(False, 2)
    head = _script(first, k, {})
    state = json.loads(json.dumps(first.state_dict()))
    assert any(s["used"] for s in state["sources"].values())
    for world_size in (1, 3):
        resumed = _world_loader(False, world_size)
        resumed.load_state_dict(state)
        assert head + _script(resumed, 30 - k, {}) == whole, (k, world_size)


def test_stats_name_the_source_the_mixture_waited_on_and_carry_each_pipelines_own():
    """``stats()``: per source its share against its weight, its epoch, the time the mixture waited
    on it (the slow source is ``bottleneck()``) and its loader's own statistics."""
    import time

    class Slow(FakeLoader):
        def __iter__(self):
            for batch in super().__iter__():
                if self.name == "b":
                    time.sleep(0.1)  # "b"'s pipeline makes a batch in 100 ms, the others at once
                yield batch

        def stats(self) -> dict:
            return {"source": self.name, "epoch": self.epoch}

    loader = MixLoader(["a", "b", "c"], lambda n, s: Slow(n, s, 4), {"a": 0.4, "b": 0.4, "c": 0.2}, seed=2,
                       batch_size=6, on_exhausted="restart", num_samples=120, source_key="src")
    rows = [r for b in loader for r in _rows(b)]
    st = loader.stats()
    assert st.position == len(rows) == 120
    assert st.bottleneck() == "b"
    assert st.sources["b"].wait_s >= 0.1 * (st.sources["b"].taken // 4)  # a wait per batch it made
    for n, s in st.sources.items():
        assert s.taken == sum(1 for j, _ in rows if loader.names[j] == n)
        assert s.share == pytest.approx(s.taken / 120)
        assert s.pipeline == {"source": n, "epoch": s.epoch}  # the source loader's own stats()
    assert "waited" in str(st) and "vs weight 0.400" in str(st)
    assert "the mixture waited longest on 'b' (its bottleneck)" in str(st)


def test_stats_give_each_sources_pipeline_rate_and_say_which_ran_out():
    """A source's rows per second come from its pipeline's ``ExecutionStats`` (rows over wall time),
    printed per source; a source dropped when it ran out says so instead of a weight of 0."""
    from sbloader.core.stats import ExecutionStats, OperatorStats
    from sbloader.loaders.mix_state import MixStats, SourceStats

    pipeline = ExecutionStats(operators=[OperatorStats("Read"), OperatorStats("Map", rows=1000)], wall_s=2.0)
    a = SourceStats(taken=600, share=0.6, share_since_change=0.0, weight=0.0, epoch=1, ended=True, wait_s=0.5,
                    pipeline=pipeline)
    b = SourceStats(taken=400, share=0.4, share_since_change=0.4, weight=1.0, epoch=1, ended=False, wait_s=0.0,
                    pipeline={"not": "execution stats"})
    assert a.rows_per_s == 500.0 and b.rows_per_s is None
    text = str(MixStats(1000, 400, {"a": a, "b": b}))
    assert "a: 600 taken" in text and "dropped (ran out)" in text and "its pipeline 500 rows/s" in text
    assert "vs weight 1.000" in text and text.count("rows/s") == 1
    assert "the mixture waited longest on 'a'" in text


class AheadLoader(FakeLoader):
    """A fake source loader that can begin its next epoch ahead: records, per call, its epoch and the
    batches the loop had taken of it."""

    asked: list = []

    def __len__(self) -> int:
        return self._batches()

    def start_ahead(self) -> bool:
        AheadLoader.asked.append((self.name, self.epoch, self.k))
        return True


@pytest.mark.parametrize("on_exhausted", ["restart", "stop", "drop"])
def test_a_restarting_source_begins_its_next_epoch_when_two_batches_are_left(on_exhausted):
    """Under ``on_exhausted="restart"`` each source's loader is asked once per epoch for its next one,
    as soon as at most ``AHEAD_BATCHES`` (2) of its batches are left to pull; the rows are the same.
    Under ``"stop"`` and ``"drop"`` an ended source waits for the next iteration: never asked."""
    from sbloader.loaders.mix_source import AHEAD_BATCHES

    AheadLoader.asked = []
    kw = dict(batch_size=4, on_exhausted=on_exhausted, num_samples=200 if on_exhausted == "restart" else None)
    plain = [r for b in iter(_loader(**kw)) for r in _rows(b)]
    ahead = MixLoader(["a", "b", "c"], lambda n, s: AheadLoader(n, s, 4), {"a": 0.5, "b": 0.3, "c": 0.2}, seed=1,
                      source_key="src", **kw)
    assert [r for b in iter(ahead) for r in _rows(b)] == plain
    if on_exhausted != "restart":
        assert AheadLoader.asked == []
        return
    for name in "abc":
        calls = [(e, k) for n, e, k in AheadLoader.asked if n == name]
        batches = -(-SIZES[name] // 4)
        assert [k for _, k in calls] == [batches - AHEAD_BATCHES] * len(calls)  # the batch that leaves 2
        assert [e for e, _ in calls] == list(range(len(calls)))  # once per epoch
        assert len(calls) >= 200 * {"a": 0.5, "b": 0.3, "c": 0.2}[name] // SIZES[name]
