"""sbloader's own reopens of an ``IterableDataset`` shard (``iterable_resume.reopen_position``), without Ray.

A segment moved to another actor, the pool taking over from the local workers, a lost block made
again: each opens the shard again from the snapshot of its last batch made. Torch's loader never
reopens a shard, so each must be exactly once whatever the dataset's ``state_dict()`` holds; a
user's resume is trusted, as torchdata trusts it.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from sbloader.loaders.iterable_resume import IterableRun, iterate_shard, public_snapshot


class CountsOnly(torch.utils.data.IterableDataset):
    """``0 .. n-1`` with a state that does not hold the position (torchdata's ``CountIterCalls``)."""

    def __init__(self, n: int = 10) -> None:
        self.n, self.iter_calls, self.made = n, 0, 0

    def __iter__(self):
        self.iter_calls += 1
        for i in range(self.n):
            self.made += 1
            yield i

    def state_dict(self) -> dict:
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict) -> None:
        pass


class Positioned(torch.utils.data.IterableDataset):
    """``0 .. n-1`` whose state holds the next item (an array, so ``==`` is not a plain bool)."""

    def __init__(self, n: int = 10) -> None:
        self.n, self.next, self.made = n, 0, 0

    def __iter__(self):
        while self.next < self.n:
            i = self.next
            self.next += 1
            self.made += 1
            yield i

    def state_dict(self) -> dict:
        return {"next": np.array([self.next, 0])}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"][0])


def _batches(dataset, resume=None, limit=None) -> tuple[list, list]:
    """Up to ``limit`` batches of 3 from ``resume`` on: (their items, their snapshots)."""
    items, snaps = [], []
    for k, (batch, _, snap) in enumerate(iterate_shard(dataset, 3, False, list, resume)):
        items += batch
        snaps.append(snap)
        if limit is not None and k + 1 >= limit:
            break
    return items, snaps


def test_a_state_that_stands_still_reopens_at_the_shards_start_and_skips_what_was_made():
    first, snaps = _batches(CountsOnly(), limit=2)
    assert first == [0, 1, 2, 3, 4, 5] and snaps[-1]["tracks"] is False and snaps[-1]["origin"] is None
    rest, _ = _batches(CountsOnly(), resume=snaps[-1])  # another actor's copy: the move of a segment
    assert first + rest == list(range(10)), "the reopen replayed or lost samples"


def test_a_chain_reopened_twice_keeps_its_origin():
    a, snaps = _batches(CountsOnly(), limit=1)
    b, snaps = _batches(CountsOnly(), resume=snaps[-1], limit=2)
    assert snaps[-1]["origin"] is None and snaps[-1]["tracks"] is False
    c, _ = _batches(CountsOnly(), resume=snaps[-1])
    assert a + b + c == list(range(10))


def test_a_state_that_holds_the_position_is_trusted_and_nothing_is_made_again():
    first, snaps = _batches(Positioned(), limit=2)
    assert snaps[-1]["tracks"] is True
    again = Positioned()
    rest, _ = _batches(again, resume=snaps[-1])
    assert first + rest == list(range(10)) and again.made == 4, "the reopen replayed instead of loading the state"


def test_a_reopen_after_a_users_resume_goes_back_to_that_resume_not_to_the_start():
    """The user's resume is the chain's origin: trusted (it loads the state), and only the samples since skipped."""
    _, snaps = _batches(Positioned(), limit=1)
    users = public_snapshot(snaps[-1])  # as state_dict() gives it: position 3
    users["dataset_state"] = {"next": np.array([3, 0])}

    class Stalled(Positioned):  # loads the position, but its state stands still from then on
        def state_dict(self) -> dict:
            return {"next": np.array([3, 0])}

    b, snaps = _batches(Stalled(), resume=users, limit=2)
    assert b == [3, 4, 5, 6, 7, 8] and snaps[-1]["tracks"] is False
    again = Stalled()
    c, _ = _batches(again, resume=snaps[-1])
    assert c == [9] and again.made == 7, "not placed at the user's resume (3) and 6 skipped"


def test_the_users_state_holds_no_chain_and_its_resume_is_trusted_as_torchdatas():
    _, snaps = _batches(CountsOnly(), limit=2)
    run = IterableRun(0, 0)
    run.took((0, copy.deepcopy(snaps[-1])))
    shard = run.state()["shards"]["0"]
    assert "origin" not in shard and "tracks" not in shard
    replayed, _ = _batches(CountsOnly(), resume=shard)
    # torchdata's StatefulDataLoader loads a stateful dataset's state and does not fast-forward: CountIterCalls
    # starts over (its tests count the __iter__ calls, not the position)
    assert replayed == list(range(10))


def test_a_dataset_without_state_counts_and_skips_as_before():
    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    first, snaps = _batches(Plain(), limit=3)
    assert snaps[-1]["dataset_state"] is None and snaps[-1]["tracks"] is False
    rest, _ = _batches(Plain(), resume=snaps[-1])
    assert first + rest == list(range(10))
