"""torch's round-robin order of an IterableDataset's shards, as a pure merge: batch ``k`` of every
shard before batch ``k+1`` of any, an exhausted shard skipped, a resumed shard going on from its ``k``."""
import random

from sbloader.loaders.shard_order import RoundRobin, merged


def test_whole_shards_in_any_arrival_order_merge_round_robin():
    sizes = [7, 2, 0, 5]
    expected = [(w, k) for k in range(7) for w in range(4) if k < sizes[w]]
    for seed in range(5):
        arrival = list(range(4))
        random.Random(seed).shuffle(arrival)
        got = list(merged(((w, [(k, (w, k)) for k in range(sizes[w])]) for w in arrival), {w: 0 for w in range(4)}))
        assert got == expected, arrival


def test_resumed_shards_go_on_from_their_k():
    # taken: batches 0..3 of the order below (shard 0: 2 batches, shard 1: 1 and ended, shard 2: 1)
    sizes = [4, 1, 3]
    full = [(w, k) for k in range(4) for w in range(3) if k < sizes[w]]
    taken = full[:4]
    next_k = {0: 2, 2: 1}  # shard 1 ended: not named
    rest = list(merged([(2, [(k, (2, k)) for k in range(1, 3)]), (0, [(k, (0, k)) for k in range(2, 4)])], next_k))
    assert taken + rest == full


def test_batches_one_at_a_time_are_released_as_soon_as_no_shard_can_come_before():
    order = RoundRobin({0: 0, 1: 0})
    order.add(1, 0, "b10")
    assert list(order.pop_ready()) == []  # shard 0's batch 0 comes first
    order.add(0, 0, "b00")
    assert list(order.pop_ready()) == ["b00", "b10"]
    order.add(1, 1, "b11")
    assert list(order.pop_ready()) == []  # shard 0 may still send its batch 1
    order.end(0)  # exhausted: skipped from now on
    assert list(order.pop_ready()) == ["b11"] and order.waiting()
    order.end(1)
    assert not order.waiting()
