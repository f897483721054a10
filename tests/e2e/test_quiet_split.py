"""What a user reads from a tiny native pipeline under torchrun: nothing (issue #46).

``tests/scripts/tiny_items_job.py``: ``from_items(480 rows)`` under 2 ranks, no seed.
The job printed ``shuffle window: a batch drew from at most 2 of 32 partitions ...``
though each batch already spans the whole range (in-memory partitions are uniform
samples), and without ``seed=`` the ranks drew different epoch seeds, cut different
plans and failed. Now: exit 0, every id exactly once, equal counts, no warning.
"""
from __future__ import annotations

import json

from _jobs import SCRIPTS, run_standalone


def test_a_tiny_from_items_pipeline_under_two_ranks_prints_no_warning(tmp_path):
    rc, output = run_standalone(tmp_path, SCRIPTS / "tiny_items_job.py")
    assert rc == 0, f"the job failed (exit {rc}):\n{output[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["batches"] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 30
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(480))
    assert "shuffle window" not in output and "Warning" not in output, output[-3000:]
