"""Exactly-once resume under real torchrun jobs killed with SIGKILL, for both loaders.

``tests/scripts/resume_job.py`` trains on a 240-sample epoch (batch 4, 2 loader
workers, random per-sample delays), checkpoints the loader state to JSON every 3
steps and SIGKILLs the whole job (torchrun and every rank) at a chosen step,
between two checkpoints. The next job, of another world size, loads the
checkpoint. The ids the killed jobs committed (logged at steps up to the
checkpoint they left behind) plus every id of the final job must be the epoch,
each exactly once; in deterministic mode (``in_order=True``) with the same world
size, the resumed job must repeat the uninterrupted job's per-rank sequence.

Every job joins one ``ray start`` cluster of the module (``RAY_ADDRESS``): one Ray
start instead of one per job; a killed job's coordinator sees its ranks' processes
gone and releases its pool. A rank killed and resumed on the job's own embedded Ray:
``test_rank_restart.py``; an embedded Ray dying with its process: ``test_threads.py``.
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import resume_runs  # noqa: E402
from _cluster import Cluster  # noqa: E402

from sbloader.core import ledger  # noqa: E402

N = 240
BS = 4
EVERY = 3  # checkpoint every 3 steps (the job's default)
DELAY = 0.02  # up to 20 ms per sample: batches finish out of order
JOB_TIMEOUT_S = 240  # one job; a loaded 2-core machine needs ~30 s


def _check_exactly_once(chain: resume_runs.Chain) -> None:
    legs = "; ".join(f"{lg.nproc} ranks from step {lg.start_step} to checkpoint {lg.ckpt_step}"
                     f"{' (killed)' if lg.killed else ' (finished)'}" for lg in chain.legs)
    assert chain.finished, f"the chain never finished the epoch: {legs}"
    lost, duplicated = chain.lost(), chain.duplicated()
    assert not lost and not duplicated, f"lost {lost}, duplicated {duplicated} (id: times) over {legs}"
    assert sorted(chain.committed()) == list(range(N))


def _check_ledgers(chain: resume_runs.Chain, ckpt_states: list) -> None:
    """Every checkpoint's ledger counts exactly what the chain committed by then."""
    committed_before = 0
    by_step = {s["step"]: s for s in ckpt_states}
    for lg in chain.legs:
        if not lg.killed:
            break
        committed_before += len(lg.committed())
        if lg.ckpt_step:
            state = by_step[lg.ckpt_step]["loader"]
            assert state["world_size"] == lg.nproc or lg.ckpt_step == lg.start_step
            assert ledger.count(state["consumed"]) == committed_before, (lg.ckpt_step, state["consumed"])


@pytest.fixture(scope="module")
def cluster():
    """The module's ``ray start`` cluster: one head of 12 CPUs (4 chains' pools of 2 side by side, with room)."""
    c = Cluster(head_cpus=12, nodes=())
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def chains(cluster, tmp_path_factory):
    """Every job of the module, the independent chains side by side (start-up dominates).

    - "2-3-1": 2 ranks killed at step 10 (checkpoint 9), 3 ranks killed at step 17
      (checkpoint 15), 1 rank to the end: two kills in a row, a resumed job of several
      ranks killed again, the world grown then shrunk. (Until 2026-12-03 two chains,
      "2-1-3" and "3-2-1", checked these between them: one chain of three legs is three
      jobs and six ranks fewer; the native chain still grows from 1 rank to 3.)
    - "ref" and "det": deterministic mode on 2 ranks, uninterrupted, and killed at
      step 11 (checkpoint 9) then resumed;
    - "native-2-1-3": 2 ranks, 1, then 3 (kills at steps 10 and 20) through a native pipeline (``to_dataloader``,
      split across the ranks by its coordinator, a shuffle window of 3).
    """
    plans = {
        "2-3-1": ([(2, 10), (3, 17), (1, -1)], dict(max_delay=DELAY)),
        "native-2-1-3": ([(2, 10), (1, 20), (3, -1)], dict(max_delay=DELAY, loader="native")),
        "ref": ([(2, -1)], dict(max_delay=DELAY, in_order=1)),
        "det": ([(2, 11), (2, -1)], dict(max_delay=DELAY, in_order=1)),
    }
    joined = dict(cluster.env, RAY_ADDRESS=cluster.address)
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = {name: pool.submit(resume_runs.run_chain, tmp_path_factory.mktemp(name), legs, n=N,
                                     timeout=JOB_TIMEOUT_S, cluster_env=joined, **flags)
                   for name, (legs, flags) in plans.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", ["2-3-1", "native-2-1-3"])
def test_sigkill_and_resume_on_another_world_size_is_exactly_once(chains, name):
    chain = chains[name]
    assert [lg.killed for lg in chain.legs] == [True] * (len(chain.legs) - 1) + [False]
    for lg in chain.legs[:-1]:
        # killed between two checkpoints, after one was saved
        assert lg.ckpt_step < lg.kill_at and lg.ckpt_step > lg.start_step, (lg.start_step, lg.ckpt_step, lg.kill_at)
        # every rank of the killed job had logged the checkpoint's step (lockstep, as under DDP)
        assert all(any(e["step"] == lg.ckpt_step for e in entries) for entries in lg.steps.values())
    final = chain.legs[-1]
    counts = {len(entries) for entries in final.steps.values()}
    assert len(counts) == 1, f"ranks of the final job ran unequal step counts {counts}"
    _check_exactly_once(chain)
    if not name.startswith("native"):  # the drop-in's ledger counts sampler positions
        _check_ledgers(chain, resume_runs.checkpoints(chain.ckpt))


def test_checkpoints_record_out_of_order_consumption(chains):
    """Non-deterministic delivery: some checkpoint's ledger is not a prefix (two or more ranges)."""
    states = [s for name in ("2-3-1",) for s in resume_runs.checkpoints(chains[name].ckpt)]
    assert states, "no checkpoint was saved"
    gappy = [s for s in states if len(s["loader"]["consumed"]) >= 2]
    assert gappy, f"every ledger was a prefix: {[s['loader']['consumed'] for s in states]}"


def test_deterministic_resume_repeats_the_uninterrupted_run(chains):
    """in_order=True, 2 ranks, killed at step 11 (checkpoint 9), resumed on 2 ranks."""
    ref, chain = chains["ref"], chains["det"]
    _check_exactly_once(ref)
    _check_exactly_once(chain)
    killed, resumed = chain.legs
    assert killed.ckpt_step == 9 and resumed.start_step == 9
    reference = ref.legs[0]
    # the killed job followed the reference, and the resumed one continues it exactly, rank by rank
    for r in range(2):
        assert [e["ids"] for e in killed.steps[r] if e["step"] <= 9] == \
            [e["ids"] for e in reference.steps[r] if e["step"] <= 9]
    assert resume_runs.per_rank_ids(resumed, 9) == resume_runs.per_rank_ids(reference, 9)
    assert resume_runs.per_rank_augs(resumed, 9) == resume_runs.per_rank_augs(reference, 9), \
        "the resumed batches drew other augmentations"
