"""A rank that stops asking for batches is reported by its rank number.

End to end: two ranks of one job simulated in one process (``rank=``/``world_size=``
overrides and a shared job id, over the session's Ray); rank 1 takes one batch
and stops, rank 0 keeps going, and the coordinator's ``silent_ranks(epoch)``
names rank 1 once ``stall_report_s`` has passed, never the rank that keeps
asking. Unit: ``Epoch._check_stuck`` (what the coordinator runs while a rank
waits in vain) logs a warning naming the silent rank.
"""
from __future__ import annotations

import logging
import time

import ray

from sbloader.distributed.specs import EpochSpec
from sbloader.distributed.epoch import Epoch
from sbloader.core.plan import EpochPlan

STALL_S = 1.5
ROWS, BATCH = 240, 4  # 30 batches per rank: rank 1's prefetch cannot take all of its share


def silent(coord, epoch: int = 0) -> list:
    return ray.get(coord.silent_ranks.remote(epoch))


def test_rank_that_stops_asking_is_named_by_silent_ranks(ray_session):
    import sbloader

    loaders = [sbloader.DataLoader(list(range(ROWS)), batch_size=BATCH, num_workers=1, rank=r, world_size=2,
                                   job_id="test-silent-rank", name="silent", stall_report_s=STALL_S,
                                   local_start=False)  # the coordinator's from the first batch
               for r in range(2)]
    per_rank = len(loaders[0])
    assert per_rank == ROWS // BATCH // 2
    its = [iter(lo) for lo in loaders]
    seen = next(its[0]).tolist() + next(its[1]).tolist()  # rank 0 starts the epoch, rank 1 joins
    coord = loaders[0]._carry.coordinator
    assert coord is not None and loaders[1]._carry.coordinator is not None
    assert silent(coord) == [], "nobody has been silent yet"

    # Rank 1 stops here (its prefetch thread fills up and stops asking); rank 0 keeps
    # taking a batch every 0.2 s for a few report periods, asking all along.
    t_stop = time.monotonic()
    reports = []  # (seconds since rank 1 stopped, silent_ranks) while rank 0 is still iterating
    taken0 = 1
    while taken0 < per_rank - 2 and time.monotonic() - t_stop < 3 * STALL_S:
        seen += next(its[0]).tolist()
        taken0 += 1
        time.sleep(0.2)
        reports.append((time.monotonic() - t_stop, silent(coord)))
    assert taken0 < per_rank, "rank 0 ran out of batches before the report period passed; raise ROWS"
    early = [s for t, s in reports if t < STALL_S * 0.5]
    late = [s for t, s in reports if t > STALL_S + 1.0]
    assert all(s == [] for s in early), f"reported before stall_report_s: {reports}"
    assert late and all(s == [1] for s in late), \
        f"rank 1 not named (or rank 0 named) {STALL_S} s after rank 1 stopped: {reports}"

    # Rank 0 finishes its share: rank 1, still owed batches, stays the only silent rank.
    seen += [x for b in its[0] for x in b.tolist()]
    assert silent(coord) == [1]
    # Rank 1 comes back: taking its prefetched batches frees its fetch thread, which asks
    # again (no longer silent) well before rank 1 has its whole share; then every row
    # arrived exactly once.
    taken1, cleared_at = 1, None
    while taken1 < per_rank:
        seen += next(its[1]).tolist()
        taken1 += 1
        deadline = time.monotonic() + 0.5
        while silent(coord) != [] and time.monotonic() < deadline:
            time.sleep(0.05)
        if silent(coord) == []:
            cleared_at = taken1
            break
    assert cleared_at is not None and cleared_at < per_rank - 5, \
        f"rank 1 asks again but is still reported (took {taken1} of {per_rank})"
    seen += [x for b in its[1] for x in b.tolist()]
    assert sorted(seen) == list(range(ROWS))


def test_check_stuck_warning_names_the_silent_rank(caplog):
    """The waiting rank's request logs, in the coordinator, which rank went silent."""
    per_rank = 5
    spec = EpochSpec(3, 0, None, (), EpochPlan(3, 0, tuple(range(3 * per_rank)), False), None, per_rank)
    ep = Epoch(spec, 3, {})
    now = time.monotonic()
    ep.logs[0].last_seen = now  # rank 0 waits (asking now)
    ep.logs[1].last_seen = now - 10 * STALL_S  # rank 1 stopped asking, owed batches
    ep.logs[2].last_seen = now - 10 * STALL_S  # rank 2 silent too, but it has all of its batches
    ep.logs[2].count = per_rank
    with caplog.at_level(logging.WARNING, logger="sbloader.distributed.epoch"):
        ep._check_stuck(0, STALL_S)
    msgs = [r.getMessage() for r in caplog.records if r.name == "sbloader.distributed.epoch"]
    assert len(msgs) == 1, msgs
    assert "rank(s) [1] stopped asking" in msgs[0] and "while rank 0 waits" in msgs[0], msgs
    assert "epoch 3" in msgs[0], msgs
    assert ep.silent_ranks(STALL_S) == [1]

    caplog.clear()
    ep.logs[1].last_seen = time.monotonic()  # rank 1 asks again: nothing to report
    with caplog.at_level(logging.WARNING, logger="sbloader.distributed.epoch"):
        ep._check_stuck(0, STALL_S)
    assert not [r for r in caplog.records if r.name == "sbloader.distributed.epoch"]
    assert ep.silent_ranks(STALL_S) == []
