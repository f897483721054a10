"""Data mixtures (``sbloader.mix``, sbloader/loaders/mix_loader.py) in one process: shares at the
weights, each source's samples once per its epoch whatever ``on_exhausted``, deterministic for a
seed, resumed exactly, reweighted mid-run, per-source statistics."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import sbloader
from sbloader.core import mix_plan

OFFSETS = {"a": 0, "b": 100_000, "c": 200_000}


def _source(name: str, n: int, parts: int = 4):
    return sbloader.from_items([{"id": OFFSETS[name] + i} for i in range(n)], num_partitions=parts)


def _plus_zero(batch: dict) -> dict:
    batch["id"] = batch["id"] + 0
    return batch


def _rows(loader, batches=None) -> list:
    """(source name, id) of every row the loop takes, in order."""
    out = []
    it = iter(loader)
    for k, b in enumerate(it):
        out += [(loader.names[s], i) for s, i in zip(b["src"].tolist(), b["id"].tolist())]
        if batches is not None and k + 1 >= batches:
            break
    return out


def _ids(rows, name) -> list:
    return [i for s, i in rows if s == name]


def _epochs_once(ids: list, n: int, offset: int) -> None:
    """Every consecutive run of ``n`` ids is the source's whole epoch; the last run has no repeats."""
    from harness import each_source_epoch_once

    each_source_epoch_once(ids, n, offset)


def _binomial(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))


def _head_then_resumed(loader, k: int):
    """The first ``k`` batches of a fresh loader (as ``(src, id)`` rows) and a new loader resumed from
    the state taken after them (JSON round-tripped)."""
    first = loader()
    it = iter(first)
    head = [list(zip(b["src"].tolist(), b["id"].tolist())) for b in (next(it) for _ in range(k))]
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    return head, resumed


@pytest.mark.parametrize("weights", [{"a": 0.7, "b": 0.3}, {"a": 0.7, "b": 0.2, "c": 0.1}])
def test_shares_within_binomial_bounds_over_10000_samples_each_epoch_once(ray_session, weights):
    sizes = {"a": 1500, "b": 700, "c": 300}
    mixed = sbloader.mix({n: _source(n, sizes[n]) for n in weights}, weights=weights, seed=3)
    loader = mixed.to_dataloader(500, shuffle=True, num_samples=10_000, source_key="src")
    rows = _rows(loader)
    assert len(rows) == 10_000
    for n, w in weights.items():
        assert _binomial(len(_ids(rows, n)), 10_000, w), (n, len(_ids(rows, n)))
        _epochs_once(_ids(rows, n), sizes[n], OFFSETS[n])  # restarted several times, each epoch whole
    # the rows follow the pure schedule exactly
    names = loader.names
    expect = mix_plan.schedule(3, (mix_plan.WeightChange(0, mix_plan.check_weights(weights, names)),), names,
                               0, 10_000)
    assert [names[j] for j in expect] == [s for s, _ in rows]
    st = loader.stats()
    assert sum(s.taken for s in st.sources.values()) == 10_000
    assert st.sources["a"].epoch >= 4 and st.sources["a"].weight == pytest.approx(weights["a"] / sum(weights.values()))
    assert st.sources["a"].share == pytest.approx(len(_ids(rows, "a")) / 10_000)
    for n in weights:  # each source pipeline's own statistics: its latest epoch's rows and rate
        assert st.sources[n].pipeline.operators[-1].rows > 0 and st.sources[n].pipeline.wall_s > 0, n


def test_stop_ends_the_iteration_when_a_source_runs_out(ray_session):
    mixed = sbloader.mix({"a": _source("a", 400), "b": _source("b", 60)}, weights={"a": 0.5, "b": 0.5}, seed=1,
                         on_exhausted="stop")
    loader = mixed.to_dataloader(32, shuffle=True, source_key="src")
    rows = _rows(loader)
    assert sorted(_ids(rows, "b")) == list(range(100_000, 100_060))  # b's whole epoch, once
    assert len(set(_ids(rows, "a"))) == len(_ids(rows, "a")) < 400
    assert loader.stats().sources["b"].ended
    again = _rows(loader)  # the next iteration: b's next epoch, a goes on where it was
    assert sorted(_ids(again, "b")) == list(range(100_000, 100_060))
    _epochs_once(_ids(rows, "a") + _ids(again, "a"), 400, 0)


def test_drop_shares_the_weight_of_a_source_that_ran_out(ray_session):
    mixed = sbloader.mix({"a": _source("a", 300), "b": _source("b", 50), "c": _source("c", 120)},
                         weights={"a": 0.4, "b": 0.4, "c": 0.2}, seed=2, on_exhausted="drop")
    loader = mixed.to_dataloader(16, shuffle=True, source_key="src")
    rows = _rows(loader)
    for n, size in (("a", 300), ("b", 50), ("c", 120)):
        assert sorted(_ids(rows, n)) == list(range(OFFSETS[n], OFFSETS[n] + size))  # every source once, all of it
    assert len(rows) == 470
    history = loader.history
    assert [h[2] for h in history][1:] == [["b"], ["b", "c"]] or [h[2] for h in history][1] == ["b"]
    last_b = max(k for k, (s, _) in enumerate(rows) if s == "b")
    assert history[1][0] == last_b + 1  # dropped from the draw after its last sample


def test_restart_each_source_epoch_once_with_short_sources(ray_session):
    mixed = sbloader.mix({"a": _source("a", 37, 3), "b": _source("b", 11, 2)}, weights={"a": 1, "b": 1}, seed=5)
    loader = mixed.to_dataloader(8, shuffle=True, num_samples=400, source_key="src")
    rows = _rows(loader)
    _epochs_once(_ids(rows, "a"), 37, 0)
    _epochs_once(_ids(rows, "b"), 11, 100_000)
    assert loader.stats().sources["b"].epoch >= 10


def test_deterministic_for_a_seed_across_concurrency(ray_session):
    def run(seed, concurrency):
        srcs = {n: _source(n, 200).map_batches(_plus_zero, concurrency=concurrency) for n in ("a", "b")}
        loader = sbloader.mix(srcs, weights={"a": 0.6, "b": 0.4}, seed=seed).to_dataloader(
            24, shuffle=True, num_samples=600, source_key="src")
        return _rows(loader)

    first = run(11, 1)
    assert run(11, 3) == first
    assert run(12, 1) != first


def _mix3(on_exhausted="restart", weights=None):
    srcs = {"a": _source("a", 90, 3), "b": _source("b", 40, 2), "c": _source("c", 25, 2)}
    return sbloader.mix(srcs, weights=weights or {"a": 0.5, "b": 0.3, "c": 0.2}, seed=7, on_exhausted=on_exhausted)


@pytest.mark.parametrize("on_exhausted,num_samples", [("restart", 300), ("drop", None), ("stop", None)])
def test_resume_at_every_step_repeats_the_rest_exactly(ray_session, on_exhausted, num_samples):
    def loader():
        return _mix3(on_exhausted).to_dataloader(13, shuffle=True, num_samples=num_samples, source_key="src")

    straight = loader()
    whole = _batches(straight)
    following = _batches(straight)  # the next iteration: what a state taken after the last batch resumes
    assert following and following != whole
    for k in [*range(0, len(whole), 3), len(whole) - 1, len(whole)]:
        head, resumed = _head_then_resumed(loader, k)
        rest = _batches(resumed)
        if k == len(whole):
            assert rest == following, "a state taken after the last batch resumes the next iteration, whole"
        else:
            assert head + rest == whole, f"resumed after {k} batches"


def _batches(loader) -> list:
    return [list(zip(b["src"].tolist(), b["id"].tolist())) for b in loader]


def test_set_weights_from_the_next_batch_add_and_remove_sources(ray_session):
    loader = _mix3(weights={"a": 1.0, "b": 0.0, "c": 0.0}).to_dataloader(10, shuffle=True, num_samples=600,
                                                                       source_key="src")
    it = iter(loader)
    before = [next(it) for _ in range(10)]
    assert all(s == 0 for b in before for s in b["src"].tolist())  # only a
    loader.set_weights({"b": 1.0})  # b added, a kept
    mid = [next(it) for _ in range(10)]
    assert {s for b in mid for s in b["src"].tolist()} == {0, 1}
    loader.set_weights({"a": 0.0, "c": 2.0})  # a removed, c added
    after = [next(it) for _ in range(10)]
    assert {s for b in after for s in b["src"].tolist()} <= {1, 2} and 2 in after[0]["src"].tolist() + \
        after[1]["src"].tolist()
    assert [h[0] for h in loader.state_dict()["history"]] == [0, 100, 200]
    rows = [(loader.names[s], i) for b in before + mid + after for s, i in zip(b["src"].tolist(), b["id"].tolist())]
    _epochs_once(_ids(rows, "a"), 90, 0)  # across both changes, no repeat or skip within an epoch
    _epochs_once(_ids(rows, "b"), 40, 100_000)
    _epochs_once(_ids(rows, "c"), 25, 200_000)
    loader.set_weights({"a": 1.0})  # a back: it goes on where it stopped
    back = [next(it) for _ in range(5)]
    rows += [(loader.names[s], i) for b in back for s, i in zip(b["src"].tolist(), b["id"].tolist())]
    _epochs_once(_ids(rows, "a"), 90, 0)
    with pytest.raises(ValueError, match="all 0"):
        loader.set_weights({"a": 0, "b": 0, "c": 0})
    with pytest.raises(ValueError, match="does not have"):
        loader.set_weights({"z": 1})


def test_resume_after_a_weight_change_and_new_weights_at_load(ray_session):
    def loader():
        return _mix3().to_dataloader(10, shuffle=True, num_samples=500, source_key="src")

    whole_loader = loader()
    it = iter(whole_loader)
    head = [next(it) for _ in range(12)]
    whole_loader.set_weights({"a": 0.1, "b": 0.1, "c": 0.8})
    head += [next(it) for _ in range(7)]
    state = json.loads(json.dumps(whole_loader.state_dict()))
    whole = [list(zip(b["src"].tolist(), b["id"].tolist())) for b in head] + _batches(_Rest(it))
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.history == state["history"] and len(state["history"]) == 2
    assert [list(zip(b["src"].tolist(), b["id"].tolist())) for b in head] + _batches(resumed) == whole
    # new weights given at load take effect from the resumed position
    again = loader()
    again.load_state_dict(state, weights={"a": 0.0, "b": 1.0, "c": 0.0})
    nxt = next(iter(again))
    assert set(nxt["src"].tolist()) == {1}
    assert again.history[-1][0] == state["position"]
    rows = [(again.names[s], i) for b in head for s, i in zip(b["src"].tolist(), b["id"].tolist())]
    rows += [(again.names[s], i) for s, i in zip(nxt["src"].tolist(), nxt["id"].tolist())]
    _epochs_once(_ids(rows, "b"), 40, 100_000)


class _Rest:
    """The rest of a running iterator, iterable once."""

    def __init__(self, it) -> None:
        self.it = it

    def __iter__(self):
        return self.it


def test_bad_input_says_what_to_do(ray_session):
    a = _source("a", 10)
    with pytest.raises(ValueError, match="on_exhausted"):
        sbloader.mix({"a": a}, weights={"a": 1}, on_exhausted="loop")
    with pytest.raises(TypeError, match="map-style torch"):
        sbloader.mix({"a": 5}, weights={"a": 1})
    wide = sbloader.from_items([{"id": np.int32(i)} for i in range(10)])
    loader = sbloader.mix({"a": a, "b": wide}, weights={"a": 1, "b": 1}).to_dataloader(8, num_samples=16)
    with pytest.raises(ValueError, match="same dtypes"):
        list(loader)
    with pytest.raises(ValueError, match="no weight to"):
        sbloader.mix({"a": a, "b": _source("b", 5)}, weights={"a": 1})
    odd = sbloader.from_items([{"other": i} for i in range(10)])
    loader = sbloader.mix({"a": a, "b": odd}, weights={"a": 1, "b": 1}).to_dataloader(8, num_samples=16)
    with pytest.raises(ValueError, match="same columns"):
        list(loader)
    state = _mix3().to_dataloader(10, num_samples=50).state_dict()
    other = sbloader.mix({"a": a}, weights={"a": 1}, seed=7).to_dataloader(10, num_samples=50)
    with pytest.raises(sbloader.StateDictError):
        other.load_state_dict(state)


def _split_make(num_samples: int):
    from harness import free_coordinators

    srcs = {"a": _source("a", 96, 4), "b": _source("b", 64, 4)}
    mixed = sbloader.mix(srcs, weights={"a": 0.6, "b": 0.4}, seed=4)
    made: list = []

    def make(rank: int, world_size: int, name: str):
        made.append(name)
        return mixed.to_dataloader(8, shuffle=True, num_samples=num_samples, rank=rank,
                                   world_size=world_size, name=name, job_id="mix-ranks")

    def free() -> None:
        for name in made:
            for source in srcs:
                free_coordinators(f"{name}.{source}")
        made.clear()

    return make, free


def test_split_across_ranks_each_rank_draws_alike_and_resumes_on_the_same_world_size(ray_session):
    from harness import run_ranks

    make, free = _split_make(40)
    try:
        # rank 0's states after 0 and 2 batches taken during the uninterrupted run (every rank waiting
        # there, as after runs cut at those steps: the harness's save_at), not from 2 runs of their own
        whole, states = run_ranks(make, 2, "mixw", "id", save_at=[0, 2])
        free()
        per_source = [[i // 100_000 for i in t.ids] for t in whole]
        assert per_source[0] == per_source[1]  # the same schedule on every rank
        for s in (0, 1):
            ids = [[i for i in t.ids if i // 100_000 == s] for t in whole]
            assert not set(ids[0]) & set(ids[1])  # each rank its own share of the source
            assert all(len(set(x)) == len(x) for x in ids)
        state = states[2]
        assert state["world_size"] == 2
        rest, _ = run_ranks(make, 2, "mixr", "id", state=state)
        free()
        for r in range(2):
            assert whole[r].batches[:2] + rest[r].batches == whole[r].batches
        assert any(v["used"] for v in state["sources"].values())  # taken partway through a source's batch
        state0 = states[0]
        assert all(v["used"] == 0 for v in state0["sources"].values())
        one, _ = run_ranks(make, 1, "mix1b", "id", state=state0)  # nothing partway: any world size
        assert len(one[0].ids) == 40 and len(set(one[0].ids)) == 40
    finally:
        free()


@pytest.mark.parametrize("old, new", [(2, 1), (1, 3), (2, 3)])
def test_a_state_taken_partway_through_source_batches_resumes_every_row_once_on_another_world_size(
        ray_session, old, new):
    """Each split source's loader credits the rows the old ranks had used of their pending batches
    (``PipelineLoader.credit_rows``): with ``on_exhausted="drop"`` the mixture reads every source
    to its end, so the rows before and after the change are each source's rows, each once. The
    ``IterableDataset`` source ``c`` every rank iterates whole (as torch's): every new rank goes on
    from rank 0's place in it, partway batch included, each of its samples once. The weights change
    after the first batch, before the state is taken."""
    from harness import free_coordinators, run_ranks

    srcs = {"a": _source("a", 90, 4), "b": _source("b", 61, 3)}
    mixed = sbloader.mix({**srcs, "c": _stream_class()(33, OFFSETS["c"])}, weights={"a": 0.5, "b": 0.3, "c": 0.2},
                         seed=11, on_exhausted="drop")

    class Reweighted:
        """The mixture's loader, its weights changed after its first batch (unless resumed)."""

        def __init__(self, loader) -> None:
            self.loader, self.loaded = loader, False

        def __iter__(self):
            it = iter(self.loader)
            yield next(it)
            if not self.loaded:
                self.loader.set_weights({"a": 0.3, "b": 0.5})
            yield from it

        def state_dict(self) -> dict:
            return self.loader.state_dict()

        def load_state_dict(self, state: dict) -> None:
            self.loaded = True
            self.loader.load_state_dict(state)

    def make(rank: int, world_size: int, name: str):
        return Reweighted(mixed.to_dataloader(8, shuffle=True, rank=rank, world_size=world_size, name=name,
                                              job_id="mix-credit"))

    names = [f"credit{old}{new}h", f"credit{old}{new}r"]
    try:
        head, state = run_ranks(make, old, names[0], "id", take=4)
        assert state["world_size"] == old and len(state["history"]) == 2  # the weight change recorded
        assert state["sources"]["a"]["used"] or state["sources"]["b"]["used"], state["sources"]  # rows to credit
        assert state["sources"]["c"]["used"], state["sources"]["c"]  # partway through the stream's batch
        rest, _ = run_ranks(make, new, names[1], "id", state=state)
        counts = [len(t.batches) for t in rest]  # "drop" ends when a rank's share runs out: a batch apart
        assert max(counts) - min(counts) <= 1, counts  # at most (user guide, "Checkpoints")
        got = [i for t in head + rest for i in t.ids]
        for name, n in (("a", 90), ("b", 61)):
            ids = sorted(i for i in got if i // 100_000 == OFFSETS[name] // 100_000)
            assert ids == list(range(OFFSETS[name], OFFSETS[name] + n)), name
        for r, t in enumerate(rest):  # rank 0's stream, gone on from where it was, on every new rank
            assert [i for i in head[0].ids + t.ids if i >= OFFSETS["c"]] == list(range(OFFSETS["c"], OFFSETS["c"] + 33)), r
    finally:
        for name in names:
            for source in srcs:
                free_coordinators(f"{name}.{source}")


class _MapStyle:
    """A map-style torch dataset of dicts with a string column."""

    def __init__(self, n: int, offset: int) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"id": self.offset + i, "name": f"s{self.offset + i}"}


def test_map_style_torch_datasets_and_string_columns(ray_session):
    mixed = sbloader.mix({"a": _MapStyle(30, 0), "b": _MapStyle(20, 100_000)}, weights={"a": 0.5, "b": 0.5}, seed=9,
                         on_exhausted="drop")
    batches = list(mixed.to_dataloader(7, shuffle=True, source_key="src"))
    ids = [i for b in batches for i in b["id"].tolist()]
    names = [n for b in batches for n in b["name"]]
    assert sorted(ids) == list(range(30)) + list(range(100_000, 100_020))
    assert names == [f"s{i}" for i in ids]  # the string column follows its rows into schedule order


def _stream_class():
    import torch.utils.data

    class Stream(torch.utils.data.IterableDataset):
        """An IterableDataset of dicts, sharded across torch workers."""

        def __init__(self, n: int, offset: int) -> None:
            self.n, self.offset = n, offset

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
            for i in range(wid, self.n, nw):
                yield {"id": self.offset + i}

    return Stream


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_source_resumed_through_its_own_state(ray_session, workers):
    stream = _stream_class()(33, 100_000)

    def loader():
        mixed = sbloader.mix({"a": _source("a", 50, 3), "b": stream}, weights={"a": 0.5, "b": 0.5}, seed=6)
        return mixed.to_dataloader(6, shuffle=True, num_samples=150, source_key="src",
                                   source_options={"b": {"num_workers": workers}})

    # each step's state taken during the uninterrupted run: the same state, key for key, as a run cut
    # and closed there (compared at these steps for 0 and 2 workers when this replaced those 5 runs)
    straight = loader()
    steps = (1, 4, 9, 17, len(straight) - 1)
    whole, states = [], {}
    for b in straight:
        whole.append(list(zip(b["src"].tolist(), b["id"].tolist())))
        if len(whole) in steps:
            states[len(whole)] = json.loads(json.dumps(straight.state_dict()))
    assert len(whole) == len(straight) and sorted(states) == list(steps)
    rows = [r for b in whole for r in b]
    _epochs_once([i for s, i in rows if s == 1], 33, 100_000)
    _epochs_once([i for s, i in rows if s == 0], 50, 0)
    assert straight.stats().sources["b"].epoch >= 2
    for k in steps:
        resumed = loader()
        resumed.load_state_dict(states[k])
        assert whole[:k] + _batches(resumed) == whole, f"resumed after {k} batches"


def test_split_across_three_ranks_resumes_on_three(ray_session):
    from harness import run_ranks

    make, free = _split_make(24)
    try:
        whole, states = run_ranks(make, 3, "mix3w", "id", save_at=[1])  # rank 0's state after 1 batch, in the run
        free()
        assert len({len(t.batches) for t in whole}) == 1
        ids = [i for t in whole for i in t.ids]
        assert len(ids) == len(set(ids)) == 72  # no source restarted: every row once across the ranks
        rest, _ = run_ranks(make, 3, "mix3r", "id", state=states[1])
        for r in range(3):
            assert whole[r].batches[:1] + rest[r].batches == whole[r].batches
    finally:
        free()


def _parquet(path, offset: int, groups: int, rows: int) -> str:
    """A Parquet file of ids from ``offset``, ``groups`` row groups of ``rows`` rows of ~8 KB each,
    half of it random: stored at about half the bytes the decoded rows take."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(offset, offset + groups * rows)
    pad = [np.random.default_rng(int(i)).bytes(4000) + bytes(4000) for i in ids]
    pq.write_table(pa.table({"id": ids, "pad": pad}), path, row_group_size=rows)
    return str(path)


@pytest.mark.filterwarnings("ignore:shuffle window")  # the window holds half the epoch, by design
@pytest.mark.parametrize("new, take", [(2, 7), (3, 5)])
def test_a_state_taken_in_one_process_partway_through_budget_window_batches_resumes_on_more_ranks(
        ray_session, tmp_path, new, take):
    """Parquet sources shuffle through a budget window. One process cuts a mixture's source batches
    as a split epoch does (``PipelineLoader.as_mixture_source``: the window in rows, from the plan),
    so ``credit_rows`` finds the rows a state taken there had used of a batch. Cut by the bytes of
    the blocks as they came (the window of a lone loader) the rows credited were others: 1-2 of
    source a's 960 rows came twice and as many never (this data is stored at half its decoded bytes,
    so the two windows differ)."""
    from harness import free_coordinators, run_ranks

    a = sbloader.read_parquet(_parquet(tmp_path / "a.parquet", 0, 96, 10))
    b = sbloader.read_parquet(_parquet(tmp_path / "b.parquet", OFFSETS["b"], 20, 10))
    mixed = sbloader.mix({"a": a, "b": b}, weights={"a": 0.6, "b": 0.4}, seed=3, on_exhausted="drop")

    def make(rank: int, world_size: int, name: str):
        return mixed.to_dataloader(16, shuffle=True, rank=rank, world_size=world_size, name=name,
                                   job_id="mix-window", memory_budget=4_000_000)

    names = [f"window1{new}h", f"window1{new}r"]
    try:
        head, state = run_ranks(make, 1, names[0], "id", take=take)
        for s in state["sources"].values():
            assert s["loader"]["window"][1] == "rows" and s["loader"]["window"][0] < 960, s["loader"]["window"]
        assert state["sources"]["a"]["used"] and state["sources"]["b"]["used"], state["sources"]
        rest, _ = run_ranks(make, new, names[1], "id", state=state)
        got = [i for t in head + rest for i in t.ids]
        for name, n in (("a", 960), ("b", 200)):
            ids = sorted(i for i in got if i // 100_000 == OFFSETS[name] // 100_000)
            assert ids == list(range(OFFSETS[name], OFFSETS[name] + n)), (name, len(ids), len(set(ids)))
    finally:
        for name in names:
            for source in ("a", "b"):
                free_coordinators(f"{name}.{source}")
