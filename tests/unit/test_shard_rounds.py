"""The rounds of segments of an ``IterableDataset`` epoch as the split coordinator runs them
(``sbloader.executor.shard_rounds.ShardRounds`` without ``fetch_blocks``): where each shard stands
comes from its blocks' metadata (the coordinator never fetches a block), each new round is charged
the bytes the consumer still holds, and a block's round says where to make it again."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from sbloader.core.errors import ExecutorShutdownError
from sbloader.executor.shard_rounds import ShardRounds

LENGTHS = {0: 7, 1: 2, 2: 4}  # batches per shard


class FakeRound:
    """One round's execution: each shard's next ``segment`` batches as one block (nothing fetched)."""

    def __init__(self, resume: dict, segment: int, log: list) -> None:
        self.items, self.charged, self.released, self.stopped = [], 0, 0, False
        log.append(self)
        for w in sorted(resume):
            k = (resume[w] or {}).get("batches", 0)
            end = min(k + segment, LENGTHS[w])
            if end > k:
                snap = {"batches": end, "ended": end == LENGTHS[w] and w == 2}  # shard 2 says it ended
                meta = SimpleNamespace(partition_id=w, batch_rows=(1,) * (end - k), nbytes=10 * (end - k),
                                       shard_state=(w, snap), first=k)
                self.items.append(SimpleNamespace(meta=meta))

    def get_next(self):
        return self.items.pop(0) if self.items else None

    def fetch(self, item):
        raise AssertionError("the coordinator's rounds never fetch a block")

    def charge(self, nbytes):
        self.charged += nbytes

    def release(self, nbytes):
        self.released += nbytes

    def shutdown(self):
        self.stopped = True

    def stats(self):
        return SimpleNamespace()


def test_rounds_follow_the_blocks_metadata_and_charge_each_new_round_what_the_consumer_holds():
    log: list = []
    rounds = ShardRounds(lambda resume, n: FakeRound(resume, n, log), {}, 3, segment=4, fetch_blocks=False)
    got, held = [], 0
    while (item := rounds.get_next()) is not None:
        start, segment = rounds.round_start(item.meta.partition_id)
        assert (start or {}).get("batches", 0) == item.meta.first  # the segment starts where its round started it
        got.append((item.meta.partition_id, item.meta.first, len(item.meta.batch_rows), segment))
        held += item.meta.nbytes
    # segments of 1, 2, then 4 batches; shard 1 ends short in round 2, shard 2 says it ended in round 3
    assert got == [(0, 0, 1, 1), (1, 0, 1, 1), (2, 0, 1, 1), (0, 1, 2, 2), (1, 1, 1, 2), (2, 1, 2, 2),
                   (0, 3, 4, 4), (2, 3, 1, 4)]
    assert {w: sum(n for s, _, n, _ in got if s == w) for w in LENGTHS} == LENGTHS
    # a 4th round finds shard 0 at its end (its 7 batches ended a full segment): no block, done
    assert rounds.rounds == 4 and log[-1].items == [] and all(r.stopped for r in log[:-1])
    # nothing released yet: each round was charged everything taken from the rounds before it
    # (taken by the rounds' thread: up to one round's blocks ahead of the consumer)
    assert [r.charged for r in log] == [0, 30, 80, 130]
    rounds.release(25)
    assert log[-1].released == 25  # the consumer's bytes are freed on the round running now
    rounds.shutdown()


def test_a_stopped_coordinator_round_raises_instead_of_ending_the_stream():
    log: list = []
    gate = threading.Event()

    class Endless(FakeRound):
        def get_next(self):
            gate.wait(5)
            return None if not self.items else self.items.pop(0)

        def shutdown(self):  # as an execution's shutdown, it lets a get_next blocked in it return (None):
            super().shutdown()  # ShardRounds.shutdown joined the fetch thread blocked in it for the gate's 5 s
            gate.set()

    rounds = ShardRounds(lambda resume, n: Endless(resume, n, log), {}, 3, segment=4, fetch_blocks=False)
    rounds.shutdown()
    gate.set()
    with pytest.raises(ExecutorShutdownError, match="shut down"):
        while True:  # blocks put before the stop may still come out first
            assert rounds.get_next() is not None


def test_segments_grow_to_the_largest_only_when_asked():
    from itertools import islice

    from sbloader.executor.shard_rounds import segments

    assert list(islice(segments(8), 6)) == [2, 4, 8, 8, 8, 8]  # the trainer's loader: full size from round 3
    assert list(islice(segments(8, 64), 8)) == [2, 4, 8, 16, 32, 64, 64, 64]  # the coordinator's: doubling
    assert list(islice(segments(1, 1), 4)) == [1, 1, 1, 1]
