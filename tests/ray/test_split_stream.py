"""An IterableDataset split across ranks by the coordinator (``split=True``): the total is unknown.

The equalising rule and the tail's re-cut are pure (``sbloader.core.split``), tested
over random interleavings without Ray; the rank-side cutting of collated batches
(``sbloader.core.batch_slice``) without Ray too; then two ranks driven in one process
(``rank=``/``world_size=`` overrides, a thread each); the real 3-rank torchrun job is in
``tests/e2e/test_torchrun.py``.
"""
from __future__ import annotations

import collections
import os
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import sbloader
from sbloader.core.batch_slice import concat_rows, mark_padding, slice_rows
from sbloader.core.split import stream_allowance, stream_tail


# ----- the equalising rule (pure) ----------------------------------------------------------


def simulate(total: int, ws: int, rng: random.Random, greedy_rank: int = -1) -> tuple:
    """Production in random chunks, ranks asking in random order for random amounts, each taking
    what the rule allows; after the end every rank asks until it is refused.

    Returns:
        (counts at the end, the highest count any rank ever had while producing).
    """
    delivered = [0] * ws
    produced = 0
    peak = 0
    while produced < total:
        produced = min(total, produced + rng.choice([1, 1, 2, 5]))
        for _ in range(rng.randint(0, 2 * ws)):
            r = greedy_rank if greedy_rank >= 0 and rng.random() < 0.7 else rng.randrange(ws)
            allow = stream_allowance(produced, delivered, r, False)
            assert allow <= produced - sum(delivered), "allowed more batches than are ready"
            delivered[r] += min(allow, rng.randint(1, 4))
            peak = max(peak, max(delivered))
            assert ws * max(delivered) <= produced, f"a rank took more than its share while producing: {delivered}"
    for _ in range(3 * ws):  # the end: every rank asks until refused, in random order
        for r in rng.sample(range(ws), ws):
            delivered[r] += stream_allowance(total, delivered, r, True)
    return delivered, peak


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5])
def test_equal_counts_at_the_end_and_no_rank_takes_a_batch_another_needs(ws):
    rng = random.Random(ws)
    for _ in range(200):
        total = rng.randint(0, 60)
        greedy = rng.choice([-1, 0, ws - 1])
        delivered, _ = simulate(total, ws, rng, greedy)
        # no deadlock: every rank reaches the quota of whole batches, none beyond it
        assert delivered == [total // ws] * ws, f"T={total} W={ws}: {delivered}"


def test_a_fast_rank_is_held_back_only_as_much_as_needed():
    # 10 produced, rank 1 has 0: rank 0 may take 5 (rank 1 can still reach 5), not 6
    assert stream_allowance(10, [0, 0], 0, False) == 5
    assert stream_allowance(10, [4, 0], 0, False) == 1
    assert stream_allowance(10, [5, 0], 0, False) == 0
    assert stream_allowance(10, [5, 0], 1, False) == 5
    assert stream_allowance(7, [3, 3, 0], 2, False) == 1  # 3 + 3 + 1 <= 7, 3 + 3 + 2 > 7
    # the end: the quota is the total // ranks
    assert stream_allowance(11, [5, 0], 1, True) == 5
    assert stream_allowance(11, [5, 5], 0, True) == 0


def test_the_tail_spreads_rows_evenly_and_pads_only_below_one_row_per_rank():
    rng = random.Random(3)
    for _ in range(300):
        ws = rng.randint(1, 5)
        rows = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
        tail = stream_tail(rows, ws)
        total = sum(rows)
        sizes = [sum(z - a for _, a, z in pieces) for pieces in tail.pieces]
        assert max(sizes) - min(sizes) <= 1 and all(s >= 1 for s in sizes), (rows, ws, tail)
        real = [(i, r) for pieces, pad in zip(tail.pieces, tail.pad) if not pad
                for i, a, z in pieces for r in range(a, z)]
        assert sorted(real) == [(i, r) for i, n in enumerate(rows) for r in range(n)], (rows, ws, tail)
        assert sum(tail.pad) == max(0, ws - total), (rows, ws, tail)
        for pieces, pad in zip(tail.pieces, tail.pad):
            assert pad in (0, 1) and (not pad or sum(z - a for _, a, z in pieces) == 1)
            assert all(0 <= a < z <= rows[i] for i, a, z in pieces)


# ----- cutting collated batches on the rank (pure) -----------------------------------------------


def test_slice_and_concat_rebuild_nested_batches():
    a = {"x": torch.arange(6).reshape(3, 2), "name": ["a", "b", "c"], "pair": (torch.arange(3), np.arange(3) * 10)}
    b = {"x": torch.arange(6, 10).reshape(2, 2), "name": ["d", "e"], "pair": (torch.arange(3, 5), np.arange(3, 5) * 10)}
    out = concat_rows([slice_rows(a, 1, 3), slice_rows(b, 0, 1)])
    assert out["x"].tolist() == [[2, 3], [4, 5], [6, 7]]
    assert out["name"] == ["b", "c", "d"]
    assert out["pair"][0].tolist() == [1, 2, 3] and out["pair"][1].tolist() == [10, 20, 30]
    assert isinstance(out["pair"], tuple)
    marked = mark_padding(out, 3, 1)
    assert marked["sbloader_padding"].tolist() == [False, False, True]
    assert "sbloader_padding" not in mark_padding(out, 3, 0)
    assert concat_rows([slice_rows(torch.arange(5), 4, 5)]).tolist() == [4]


def test_a_batch_that_cannot_be_cut_names_its_type_and_drop_last():
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"Custom.*drop_last=True"):
        slice_rows({"x": torch.zeros(2), "obj": Custom()}, 0, 1)


# ----- two ranks in one process -------------------------------------------------------------------


class Filtered(IterableDataset):
    """Ids 0..n-1 without the multiples of 7 (the total is unknown to the loader), sharded over the
    worker shards by get_worker_info(), as under torch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            if i % 7:
                yield {"id": i, "x": torch.full((3,), float(i))}


def expected_ids(n: int) -> list:
    return [i for i in range(n) if i % 7]


def run_ranks(name: str, ws: int, keep: list | None = None, dataset: Any = None, take: int | None = None,
              **kwargs) -> list:
    """Iterate one epoch on ``ws`` ranks (a thread each); per rank, its batches as (ids, padding flags).
    ``keep``: receives the loaders; ``dataset``: makes each rank's dataset (default ``Filtered(n)``);
    ``take``: each rank stops after that many batches."""
    n = kwargs.pop("n", None)
    loaders = [sbloader.DataLoader(dataset() if dataset is not None else Filtered(n), rank=r, world_size=ws,
                                   job_id=f"test-stream-{name}", name=name, split=True, **kwargs) for r in range(ws)]
    out = [None] * ws
    errors = []

    def rank_loop(r: int) -> None:
        try:
            got = []
            for batch in loaders[r]:
                pad = batch.get("sbloader_padding")
                ids = batch["id"].tolist()
                assert batch["x"][:, 0].tolist() == [float(i) for i in ids]  # rows stay aligned across keys
                got.append((ids, pad.tolist() if pad is not None else [False] * len(ids)))
                if len(got) == take:
                    break
            out[r] = got
        except BaseException as e:  # surfaced in the test thread
            errors.append(e)

    if keep is not None:
        keep.extend(loaders)
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ws)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 120 s (deadlock?)"
    if errors:
        raise errors[0]
    with pytest.raises(TypeError, match="has no len()"):
        len(loaders[0])
    return out


def real_ids(ranks: list) -> list:
    return sorted(i for b in ranks for ids, pads in b for i, p in zip(ids, pads) if not p)


def test_two_ranks_every_sample_once_equal_counts_short_last_batches(ray_session):
    # 88 ids kept, 3 worker shards of 30, 29, 29 ids in batches of 6: 5 + 5 + 5 batches, the last one
    # of the second and third shards of 5 rows. 15 batches over 2 ranks: 7 whole each, one left over
    # (a 5-row one, the shortest) cut as 3 + 2.
    n, bs = 103, 6
    ranks = run_ranks("short-tail", 2, n=n, batch_size=bs, num_workers=3)
    assert [len(b) for b in ranks] == [8, 8], f"batches per rank {[len(b) for b in ranks]}"
    real = real_ids(ranks)
    assert real == expected_ids(n), collections.Counter(real).most_common(3)
    assert not any(p for b in ranks for _, pads in b for p in pads)  # 5 rows for 2 ranks: no padding
    assert sorted(len(b[-1][0]) for b in ranks) == [2, 3], [b[-1][0] for b in ranks]
    whole = sorted(len(ids) for b in ranks for ids, _ in b[:-1])
    assert whole == [5] + [6] * 13, f"whole batches of {whole} rows: the workers' batches, as made"


def test_three_ranks_short_tail_from_two_shards(ray_session):
    # 2 shards of 44 ids in batches of 4: 22 full batches over 3 ranks: 7 each, one left: 2 + 1 + 1 rows
    n = 103
    ranks = run_ranks("three", 3, n=n, batch_size=4, num_workers=2)
    assert [len(b) for b in ranks] == [8, 8, 8]
    assert real_ids(ranks) == expected_ids(n)
    assert sorted(len(b[-1][0]) for b in ranks) == [1, 1, 2]
    assert not any(p for b in ranks for _, pads in b for p in pads)


def test_three_ranks_pad_marks_repeated_rows(ray_session):
    # 13 ids kept (0..15 without 0, 7, 14), one shard, batches of 4: 4 batches (4, 4, 4, 1) over 3 ranks:
    # one whole batch each, the 1-row batch left over: rank 0 gets it, ranks 1, 2 a marked repeat
    n = 16
    ranks = run_ranks("pad", 3, n=n, batch_size=4, num_workers=1)
    assert [len(b) for b in ranks] == [2, 2, 2]
    assert real_ids(ranks) == expected_ids(n)
    pads = [i for b in ranks for ids, flags in b for i, p in zip(ids, flags) if p]
    assert len(pads) == 2 and set(pads) <= set(expected_ids(n))
    for b in ranks:
        assert len(b[-1][0]) == 1  # the short last batch


# SBLOADER_REPEAT_EMPTY_STREAM=50 runs it 50 times in this process (issue #41: the ranks' arrival raced;
# not in CI): python3 -m pytest -q tests/ray/test_split_stream.py -k empty_stream
@pytest.mark.parametrize("repeat", range(int(os.environ.get("SBLOADER_REPEAT_EMPTY_STREAM", "1"))))
def test_an_empty_stream_ends_every_rank_at_once(ray_session, repeat):
    # id 0 is filtered out: both shards yield nothing, every rank gets no batch (and does not wait)
    loaders: list = []
    assert run_ranks(f"empty-{repeat}", 2, keep=loaders, n=1, batch_size=4, num_workers=2) == [[], []]
    if repeat:  # the coordinator of a repeat goes with it (one job per repeat)
        import ray

        ray.get(loaders[0]._carry.coordinator.shutdown.remote())
        ray.kill(loaders[0]._carry.coordinator)


@pytest.mark.parametrize("ws", [2, 3])
def test_drop_last_equal_counts_of_whole_batches(ray_session, ws):
    n, bs = 103, 5  # 2 shards of 44 ids: 8 full batches each (the short 4-row ones dropped by the workers)
    ranks = run_ranks(f"drop-last-{ws}", ws, n=n, batch_size=bs, num_workers=2, drop_last=True)
    counts = [len(b) for b in ranks]
    assert counts == [16 // ws] * ws, counts
    rows = [i for b in ranks for ids, _ in b for i in ids]
    assert len(rows) == len(set(rows)) and set(rows) <= set(expected_ids(n))
    assert all(len(ids) == bs for b in ranks for ids, _ in b), "drop_last gave a short batch"


class Endless(IterableDataset):
    """Ids without end, sharded over the worker shards by get_worker_info()."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        i = wid
        while True:
            yield {"id": i, "x": torch.full((3,), float(i))}
            i += nw


def test_an_endless_stream_split_across_ranks_keeps_yielding_and_stops_with_the_ranks(ray_session):
    # Each worker shard runs in segments at the coordinator, round after round (2, 4, 8, then 16 batches):
    # 30 batches per rank need 4 rounds of 2 shards. Before, each shard ran whole as one block, so no
    # rank of an endless stream ever got a batch.
    ws, want = 2, 30
    out = run_ranks("endless", ws, dataset=Endless, take=want, batch_size=4, num_workers=2)
    ids = [i for got in out for b, _ in got for i in b]
    assert [len(got) for got in out] == [want] * ws and all(len(b) == 4 for got in out for b, _ in got)
    assert len(ids) == len(set(ids)), "a sample reached two ranks"
