"""The pure rules of a split stream's local start (:mod:`sbloader.loaders.stream_start`), without Ray.

Each rank runs its own shards (``w % world_size == rank``) and delivers no more than
``local_allowance`` lets it; then the coordinator goes on from every rank's count with
``stream_allowance``. Over random shard lengths, handover points and interleavings, every
rank ends with the same count and no rank ever holds more than its final share.
"""
from __future__ import annotations

import random

import pytest

from sbloader.core.split import local_allowance, stream_allowance
from sbloader.loaders.stream_start import own_shards


@pytest.mark.parametrize("ws,nw", [(1, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 4), (3, 7)])
def test_the_ranks_own_shards_cover_every_shard_once(ws, nw):
    owned = [w for r in range(ws) for w in own_shards(nw, ws, r)]
    assert sorted(owned) == list(range(nw))
    assert all(w % ws == r for r in range(ws) for w in own_shards(nw, ws, r))


def test_the_allowance_is_what_every_rank_is_sure_to_reach():
    assert local_allowance(0, 0, 2) == 0
    assert local_allowance(1, 0, 2) == 0  # one batch made: the other rank may never reach 1
    assert local_allowance(2, 0, 2) == 1
    assert local_allowance(9, 2, 3) == 1
    assert local_allowance(9, 3, 3) == 0
    assert local_allowance(5, 5, 1) == 0 and local_allowance(6, 5, 1) == 1


def _epoch(rng: random.Random, ws: int, nw: int) -> tuple[list, list, int]:
    """One epoch: shard lengths at random; each rank makes a random prefix of its shards locally and
    delivers as the rule allows; the coordinator takes over. Returns (final counts, local counts, total)."""
    lengths = [rng.choice([0, 1, 2, 5, 13, 40]) for _ in range(nw)]
    local, made_by = [0] * ws, [0] * ws
    for r in range(ws):
        made = sum(min(lengths[w], rng.randint(0, 20)) for w in own_shards(nw, ws, r))
        made_by[r] = made
        local[r] = min(local_allowance(made, 0, ws), rng.randint(0, 20))  # handed over at any point
    total = sum(lengths)
    delivered = list(local)
    produced = sum(local)  # the coordinator counts the local batches, then makes the rest
    while produced < total:
        produced = min(total, produced + rng.choice([1, 2, 5]))
        for _ in range(rng.randint(0, 2 * ws)):
            r = rng.randrange(ws)
            delivered[r] += min(stream_allowance(produced, delivered, r, False), rng.randint(1, 4))
            assert ws * max(delivered) <= max(produced, ws * max(local)), delivered
    for _ in range(3 * ws):
        for r in rng.sample(range(ws), ws):
            delivered[r] += stream_allowance(total, delivered, r, True)
    return delivered, local, total


@pytest.mark.parametrize("ws,nw", [(1, 2), (2, 2), (2, 3), (3, 2), (2, 4), (4, 4), (3, 7)])
def test_local_deliveries_never_exceed_a_ranks_final_share(ws, nw):
    rng = random.Random(ws * 100 + nw)
    for _ in range(300):
        delivered, local, total = _epoch(rng, ws, nw)
        assert all(n <= total // ws for n in local), (local, total)
        assert delivered == [total // ws] * ws, (delivered, local, total)


def test_a_locally_started_stream_epoch_without_segments_is_refused():
    """A stream started on the ranks' local workers resumes each shard from their reports, which only a
    segmented epoch does: a spec that asks for reports without a segment says so at once."""
    from sbloader.distributed.dropin_client import stream_spec
    from sbloader.executor.options import ExecutionOptions

    with pytest.raises(ValueError, match="needs a segment"):
        stream_spec(0, 1, 2, {}, None, ExecutionOptions(), False, segment=None, reports=True)
    assert stream_spec(0, 1, 2, {}, None, ExecutionOptions(), False, segment=8, reports=True).reports
