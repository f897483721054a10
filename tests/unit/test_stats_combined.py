"""Statistics of executions run one after another, as one (an IterableDataset epoch's rounds)."""
from __future__ import annotations

from sbloader.core.stats import ExecutionStats, OperatorStats, combined


def _part(rows: int, first: float, peak: int, hits: int, misses: int, node: str) -> ExecutionStats:
    read = OperatorStats("Read", rows=rows, blocks=2, tasks=2, task_s=1.5, pool_limit=2,
                         counters={"cache_hits": hits, "cache_misses": misses})
    return ExecutionStats(operators=[read, OperatorStats("Map", rows=rows)], wall_s=2.0, first_block_s=first,
                          peak_held_bytes=peak, memory_budget=100, rerun_partitions=1, lost_nodes=[node])


def test_counts_are_summed_peaks_are_the_largest_and_the_first_block_is_the_first_rounds():
    out = combined([_part(10, 0.5, 30, 3, 1, "n1"), _part(6, 0.1, 50, 1, 3, "n1"), _part(4, 0.2, 20, 0, 0, "n2")])
    assert out.wall_s == 6.0 and out.first_block_s == 0.5
    assert out.peak_held_bytes == 50 and out.memory_budget == 100
    assert out.rerun_partitions == 3 and out.lost_nodes == ["n1", "n2"]
    read, mapped = out.operators
    assert (read.name, read.rows, read.blocks, read.tasks, read.task_s, read.pool_limit) == ("Read", 20, 6, 6, 4.5, 2)
    assert mapped.rows == 20
    assert read.counters == {"cache_hits": 4, "cache_misses": 4, "cache_hit_ratio": 0.5}


def test_one_part_is_itself():
    part = _part(1, 0.1, 1, 0, 0, "n")
    assert combined([part]) is part
