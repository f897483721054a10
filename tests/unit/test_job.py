"""A job's identity (sbloader.runtime.job): from what the launcher provides, never a constant."""
from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import HashStore

from sbloader.runtime import job as jobmod
from sbloader.runtime.job import JobIdentity, JobIdentityError, identify
from sbloader.runtime.world import World

LAUNCHER_VARS = ("SBLOADER_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR",
                 "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jobmod, "_CACHE", {})
    monkeypatch.setattr(jobmod, "_group_store", lambda: None)


def test_a_given_id_wins_and_its_token_is_derived(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    a = identify(World(rank=1, world_size=2, job_id="mine"))
    assert (a.job_id, a.source) == ("mine", "job_id=")
    assert a.token == jobmod.token_of("mine") != jobmod.token_of("other")
    monkeypatch.setenv("SBLOADER_JOB_ID", "from-env")
    assert identify(World(rank=0, world_size=2)).job_id == "from-env"


def test_a_world_of_one_draws_an_id_per_process():
    a = identify(World())
    assert a.source == "process" and a.job_id.startswith("local-")
    assert identify(World()) is a, "memoized: every loader of the process is in one job"
    jobmod._CACHE.clear()
    assert identify(World()).job_id != a.job_id, "another process (here: a cleared cache) is another job"


@pytest.mark.parametrize("run_id", ["none", "", "None", "default"])
def test_constant_run_ids_identify_nothing_and_fail_fast_naming_the_fixes(monkeypatch, run_id):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    t0 = time.monotonic()
    with pytest.raises(JobIdentityError) as info:
        identify(World(rank=1, world_size=2))
    assert time.monotonic() - t0 < 2.0
    text = str(info.value)
    assert "init_process_group" in text and "job_id=" in text and "SBLOADER_JOB_ID" in text


def test_a_unique_run_id_is_used_with_the_restart_count(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a9c")
    a = identify(World(rank=0, world_size=2, restart_count=1))
    b = identify(World(rank=1, world_size=2, restart_count=1))
    assert a.job_id == b.job_id == "3f2a9c-1" and a.token == b.token and a.source == "torchelastic"


def test_a_process_group_store_gives_all_ranks_rank_zeros_draw(monkeypatch):
    """Four ranks (threads) sharing one store: rank 0 draws, the others wait for it, whatever the order."""
    store = HashStore()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(jobmod, "_group_store", lambda: store)
    got: dict[int, JobIdentity] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        got[r] = jobmod._identify(World(rank=r, world_size=4))

    threads = [threading.Thread(target=rank, args=(r, 0.3 if r == 0 else 0.0)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({(g.job_id, g.token) for g in got.values()}) == 1
    assert got[0].source == "process group"
    # another job (another store) draws another identity
    monkeypatch.setattr(jobmod, "_group_store", lambda: HashStore())
    assert jobmod._identify(World(rank=0, world_size=4)).job_id != got[0].job_id


def test_namespaces_are_per_job_and_safe():
    a = JobIdentity("a/b c", "t", "job_id=")
    assert a.namespace == "sbloader-a_b_c"
    assert JobIdentity("x", "t", "job_id=").namespace != a.namespace
