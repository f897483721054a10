"""What the coordinator keeps for ranks that arrive late, and what it says otherwise (issue #41); pure."""
from __future__ import annotations

from sbloader.distributed.epoch import RankLog
from sbloader.distributed.job_watch import DRIVERS_GONE_GRACE_S, LATE_RANK_GRACE_S, JobWatch
from sbloader.distributed.late_ranks import EndedEpochs, overflow, rank0_doing, unknown_epoch


def test_ended_epochs_are_remembered_bounded_and_answer_with_the_end():
    ended = EndedEpochs(kept=3)
    for e in range(5):
        ended.add(e, e * 10, stream=(e == 4))
    assert ended.epochs() == [2, 3, 4] and 1 not in ended and 2 in ended
    assert ended.per_rank(3) == 30
    assert ended.reply(3) == {"refs": [], "metas": [], "index": [], "done": True}
    assert ended.reply(4) == {"batches": [], "done": True}


class _Ep:
    def __init__(self, logs: list, per_rank) -> None:
        self.logs, self.per_rank = logs, per_rank


def test_rank0_doing_says_where_rank_0_is():
    assert rank0_doing({}, EndedEpochs()) == "rank 0 has started no epoch on this coordinator"
    ended = EndedEpochs()
    ended.add(0, 3, False)
    log = RankLog(count=2, last_seen=90.0, asked=True)
    text = rank0_doing({1: _Ep([log, RankLog()], 5)}, ended, now=100.0)
    assert text == ("rank 0 started epoch(s) [1] (held) and [0] (ended) here; in epoch 1 it has received 2 of 5 "
                    "batches and last asked 10 s ago"), text
    err = unknown_epoch(7, 1, 300.0, {1: _Ep([RankLog(), RankLog()], None)}, ended)
    assert str(err).startswith("rank 1 asked for epoch 7, which rank 0 did not start within 300 s; rank 0 started "
                               "epoch(s) [1] (held) and [0] (ended) here; in epoch 1 it has received 0 of an "
                               "unknown number of batches and has not asked for any"), str(err)


def test_overflow_drops_the_oldest_epochs_naming_ranks_that_never_came():
    held = {e: _Ep([RankLog(asked=True), RankLog(left=(e == 1))], 1) for e in range(6)}
    assert overflow(held, limit=4) == [(0, [1]), (1, [])]
    assert overflow(held, limit=6) == []


def test_the_coordinator_waits_longer_for_a_rank_that_never_said_hello():
    watch = JobWatch()
    watch.claim(0, "job-a")
    dead = lambda d: False  # noqa: E731 (every recorded process is gone)
    assert not watch.over(now=0.0, world_size=2, alive=dead)
    assert not watch.over(now=DRIVERS_GONE_GRACE_S + 1, world_size=2, alive=dead)  # rank 1 may still come
    assert watch.over(now=LATE_RANK_GRACE_S + 1, world_size=2, alive=dead)
    full = JobWatch()
    full.claim(0, "job-a")
    full.claim(1, "job-b")
    assert not full.over(now=0.0, world_size=2, alive=dead)
    assert full.over(now=DRIVERS_GONE_GRACE_S + 1, world_size=2, alive=dead)
