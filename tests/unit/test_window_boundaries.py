"""A window of one partition never says "narrowed" because a batch spans a partition boundary (issue #46).

A native ``from_items(480 rows)`` pipeline under 2 ranks (32 partitions of 15 rows,
batches of 8) warned ``a batch drew from at most 2 of 32 partitions ... the data does
not fit it``: a batch of 8 takes the end of one partition and the start of the next,
which the window of 1 did not hold back. Its partitions are uniform samples: window 1
is right there.
"""
from __future__ import annotations

import pytest

from sbloader.core.cut import cut_plan


@pytest.mark.parametrize("world_size", [1, 2])
def test_batches_spanning_partition_boundaries_are_not_a_narrowed_window(world_size) -> None:
    plan = cut_plan([15] * 32, 8, world_size, False, 1, 0)
    assert plan.widest == 2  # batches do span two partitions...
    assert not plan.narrowed  # ...which a window of one partition did not hold back


def test_a_window_of_several_partitions_that_holds_one_back_still_says_narrowed() -> None:
    plan = cut_plan([64] * 32, 8, 2, False, 3, 0)
    assert plan.narrowed and plan.widest == 3
