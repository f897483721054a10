"""World.detect: torchrun's environment, overrides and validation."""
from __future__ import annotations

import pytest

from sbloader.runtime.world import World

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "SBLOADER_JOB_ID")


@pytest.fixture
def env(monkeypatch):
    """A clean environment without torchrun's variables; returns a setter."""
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)

    def set_env(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    return set_env


def test_outside_torchrun_is_a_world_of_one(env):
    w = World.detect()
    assert w == World(rank=0, world_size=1, local_rank=0, local_world_size=1, job_id=None, restart_count=0)
    assert w.single_node


def test_torchrun_single_node(env):
    env(RANK=2, WORLD_SIZE=3, LOCAL_RANK=2, LOCAL_WORLD_SIZE=3, TORCHELASTIC_RUN_ID="job-7",
        TORCHELASTIC_RESTART_COUNT=1)
    w = World.detect()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (2, 3, 2, 3)
    assert (w.job_id, w.restart_count) == (None, 1)  # the run id is read by runtime.job.identify
    assert w.single_node


def test_torchrun_multi_node(env):
    env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, TORCHELASTIC_RUN_ID="j")
    w = World.detect()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (5, 8, 1, 4)
    assert not w.single_node


def test_local_world_size_defaults_to_world_size_under_torchrun(env):
    env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1)
    w = World.detect()
    assert (w.local_rank, w.local_world_size) == (1, 2)
    assert w.single_node


def test_without_local_rank_a_rank_is_alone_on_its_node(env):
    env(RANK=1, WORLD_SIZE=2)
    w = World.detect()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (1, 2, 0, 1)
    assert not w.single_node


def test_overrides_win_over_the_environment(env):
    env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="env-job")
    w = World.detect(rank=1, world_size=4, job_id="mine")
    assert (w.rank, w.world_size, w.job_id) == (1, 4, "mine")
    assert (w.local_rank, w.local_world_size) == (0, 2)  # LOCAL_* still from torchrun


def test_rank_override_without_torchrun(env):
    w = World.detect(rank=3, world_size=4)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (3, 4, 0, 1)
    assert w.job_id is None


def test_job_id_given_by_the_user(env):
    env(SBLOADER_JOB_ID="sb", TORCHELASTIC_RUN_ID="te")
    assert World.detect().job_id == "sb"
    assert World.detect(job_id="explicit").job_id == "explicit"


@pytest.mark.parametrize("values, message", [
    (dict(RANK=2, WORLD_SIZE=2), "rank=2, world_size=2"),
    (dict(RANK=-1, WORLD_SIZE=2), "rank=-1, world_size=2"),
    (dict(RANK=0, WORLD_SIZE=0), "rank=0, world_size=0"),
])
def test_invalid_environment_is_rejected(env, values, message):
    env(**values)
    with pytest.raises(ValueError, match=message):
        World.detect()


def test_invalid_override_is_rejected(env):
    env(RANK=0, WORLD_SIZE=2)
    with pytest.raises(ValueError, match="rank=5, world_size=2"):
        World.detect(rank=5)


def test_non_integer_variable_is_rejected(env):
    env(RANK="zero", WORLD_SIZE=2)
    with pytest.raises(ValueError):
        World.detect()


def test_world_validation():
    with pytest.raises(ValueError, match="local_rank < local_world_size"):
        World(local_rank=2, local_world_size=2)
    with pytest.raises(ValueError, match="rank < world_size"):
        World(rank=1, world_size=1)
