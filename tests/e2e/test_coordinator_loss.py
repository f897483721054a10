"""The split coordinator's process dies mid-epoch: the ranks rebuild it and lose nothing (issue #46).

``tests/scripts/coordinator_kill_job.py`` under ``torchrun --standalone`` (2 ranks, one
embedded Ray): rank 0 SIGKILLs the coordinator actor's process (by its pid) after 6 of
its 30 batches of epoch 0, the ranks stepping in lockstep. The job must exit 0, every
sample exactly once per epoch, the same count on every rank, a new coordinator process
in use, and the loader's ``stats()`` must say one coordinator was rebuilt.
"""
from __future__ import annotations

import json

import pytest

from _jobs import SCRIPTS, run_side_by_side

ROWS, BATCH, WORLD = 480, 8, 2
MODES = ("native", "dropin")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Both modes' jobs side by side, each on its own embedded Ray: mode -> (its folder, exit code, output)."""
    outs = {mode: tmp_path_factory.mktemp(mode) for mode in MODES}
    args = ("--rows", str(ROWS), "--kill-at", "6")
    done = run_side_by_side({mode: (outs[mode], SCRIPTS / "coordinator_kill_job.py", ("--mode", mode, *args),
                                    {"world": WORLD}) for mode in MODES})
    return {mode: (outs[mode], *done[mode]) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_coordinator_process_killed_mid_epoch_is_rebuilt_exactly_once(jobs, mode):
    tmp_path, rc, output = jobs[mode]
    assert rc == 0, f"the job failed (exit {rc}) after its coordinator's process was killed:\n{output[-12000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    per_rank = ROWS // BATCH // WORLD
    killed = ranks[0].get("killed_pid")
    assert killed, "rank 0 did not kill the coordinator's process: the test proves nothing"
    assert ranks[0]["final_pid"] != killed, "the coordinator in use at the end is the killed process"
    for epoch in range(2):
        counts = [len(lg["epochs"][epoch]["batches"]) for lg in ranks]
        assert counts == [per_rank] * WORLD == [lg["len"] for lg in ranks], \
            f"epoch {epoch}: batches per rank {counts}, expected {per_rank} on every rank"
        ids = sorted(i for lg in ranks for b in lg["epochs"][epoch]["batches"] for i in b)
        assert ids == list(range(ROWS)), \
            f"epoch {epoch}: {len(ids)} ids, {len(set(ids))} distinct; missing {sorted(set(range(ROWS)) - set(ids))[:10]}"
    stats0 = " ".join(lg["epochs"][0]["stats"] for lg in ranks)
    assert "1 coordinator(s) rebuilt" in stats0, f"stats() does not report the rebuild: {stats0[-600:]}"
