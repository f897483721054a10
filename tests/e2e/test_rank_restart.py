"""A rank killed alone under ``torchrun --max-restarts=1``: the restarted job resumes exactly once (issue #46).

``tests/scripts/rank_restart_job.py`` (2 ranks in lockstep, 160 samples, batches of 4,
a checkpoint of the loader every 3 steps): rank 1 SIGKILLs its own process at step 10
of the first attempt, before that step's barrier, so the last checkpoint is step 9.
torchrun stops rank 0 and starts the job again, which loads the checkpoint. What the
job committed (the first attempt's steps up to 9, then every step of the second)
must be every sample exactly once, with equal counts per rank, and the job exits 0.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _jobs import SCRIPTS, run_side_by_side

N, BATCH, EVERY, DIE_AT = 160, 4, 3, 10
TIMEOUT_S = 300


def _steps(out: Path, attempt: int, rank: int) -> list[dict]:
    path = out / f"attempt{attempt}.rank{rank}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


LOADERS = ("dropin", "native")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Both loaders' jobs side by side, each on its own embedded Ray: loader -> (its folder, exit code, output)."""
    outs = {loader: tmp_path_factory.mktemp(loader) for loader in LOADERS}
    done = run_side_by_side({
        loader: (outs[loader], SCRIPTS / "rank_restart_job.py",
                 ("--ckpt", str(outs[loader] / "ckpt.json"), "--loader", loader, "--samples", str(N), "--batch-size",
                  str(BATCH), "--ckpt-every", str(EVERY), "--die-rank", "1", "--die-at", str(DIE_AT)),
                 {"max_restarts": 1, "timeout_s": TIMEOUT_S}) for loader in LOADERS})
    return {loader: (outs[loader], *done[loader]) for loader in LOADERS}


@pytest.mark.parametrize("loader", LOADERS)
def test_a_rank_killed_alone_restarts_and_resumes_exactly_once_from_the_last_checkpoint(jobs, loader):
    tmp_path, rc, output = jobs[loader]
    assert rc == 0, f"the restarted job failed (exit {rc}):\n{output[-4000:]}"
    first = [_steps(tmp_path, 0, r) for r in range(2)]
    second = [_steps(tmp_path, 1, r) for r in range(2)]
    assert max(s["step"] for s in first[1]) == DIE_AT, "rank 1 did not die at its step: the test proves nothing"
    assert second[0] and second[1], "torchrun did not restart the job"
    last_ckpt = (DIE_AT - 1) // EVERY * EVERY  # rank 1 died before step 10's barrier: no checkpoint at 10
    for r in range(2):
        assert second[r][0]["step"] == last_ckpt + 1, f"rank {r} resumed at step {second[r][0]['step']}, " \
            f"not after the last checkpoint ({last_ckpt})"
    committed = [[s for s in first[r] if s["step"] <= last_ckpt] + second[r] for r in range(2)]
    assert len(committed[0]) == len(committed[1]) == N // BATCH // 2, [len(c) for c in committed]
    ids = sorted(i for c in committed for s in c for i in s["ids"])
    assert ids == list(range(N)), f"{len(ids)} ids, {len(set(ids))} distinct over the restart"
