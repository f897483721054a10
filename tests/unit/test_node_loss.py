"""A lost node or pool actor is the system's failure: classified, re-run (bounded), reported once (issue #35)."""
from __future__ import annotations

import logging

import pytest
import ray

from sbloader.core.errors import TaskLostError
from sbloader.core.stats import ExecutionStats, StallStats
from sbloader.executor.calls import Call, Running
from sbloader.executor.failures import MAX_RERUNS, Rerun, sort_failures, system_failure
from sbloader.executor.reruns import Reruns
from sbloader.sources.base import Partition


def _actor_died(init_failed: bool) -> ray.exceptions.ActorDiedError:
    e = ray.exceptions.ActorDiedError()
    if init_failed:
        e._actor_init_failed = True  # as Ray sets it when the constructor raised
    return e


@pytest.mark.parametrize("error, system", [
    (ray.exceptions.ActorUnavailableError("unreachable", b"a" * 16), True),
    (ray.exceptions.ActorDiedError(), True),
    (ray.exceptions.NodeDiedError("node gone"), True),
    (ray.exceptions.ObjectLostError("00" * 28, "", ""), True),
    (ray.exceptions.OwnerDiedError("00" * 28, "", ""), True),
    (ray.exceptions.LocalRayletDiedError(), True),
    (ValueError("the user's function raised"), False),
    (ray.exceptions.WorkerCrashedError(), False),  # a task's worker: Ray retried it already
])
def test_a_lost_actor_or_node_is_the_systems_failure_anything_else_is_not(error, system):
    assert system_failure(error) is system


def test_an_actor_whose_constructor_raised_is_the_users_failure():
    assert system_failure(_actor_died(init_failed=True)) is False
    assert system_failure(_actor_died(init_failed=False)) is True


class _Ref:
    """Stands for an object ref whose ``ray.get`` raises (``sort_failures`` calls ray.get on it)."""


def _running(pid: int = 7, stage: int = 0) -> Running:
    part = Partition(pid, 10, None, f"part {pid}")
    return Running(stage, 3, _Ref(), 0, 0.0, Call(1, None, ((3, part),)), pid)


def test_sort_failures_turns_a_lost_call_into_a_rerun_and_raises_the_users_error(monkeypatch):
    lost_ref, user_ref = _Ref(), _Ref()
    errors = {lost_ref: ray.exceptions.ActorUnavailableError("unreachable", b"a" * 16), user_ref: KeyError("x")}

    def get(ref, timeout=None):
        raise errors.get(ref, RuntimeError("block ref"))

    monkeypatch.setattr(ray, "get", get)
    inflight = {lost_ref: _running(), user_ref: _running(8)}
    out = sort_failures([lost_ref], inflight, lambda run: False, ["read"], 0)
    assert len(out) == 1 and isinstance(out[0], Rerun)
    with pytest.raises(TaskLostError, match=r"partition\(s\) \[8\]"):
        sort_failures([user_ref], inflight, lambda run: False, ["read"], 0)


def test_reruns_are_counted_bounded_and_warned_once_per_node(caplog):
    stats = ExecutionStats()
    reruns = Reruns(4, stats)
    e = ray.exceptions.ActorUnavailableError("unreachable", b"a" * 16)
    with caplog.at_level(logging.WARNING, logger="sbloader.executor.reruns"):
        for pid in range(3):
            reruns.record(_running(pid), e, "read", "nodeA")
        reruns.record(_running(9), e, "read", "nodeB")
        reruns.record(_running(10), e, "read", None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # nodeA, nodeB, one unknown: one line per event
    assert "lost node nodeA" in lines[0] and "epoch 4" in lines[0]
    assert stats.rerun_partitions == 5 and stats.lost_nodes == ["nodeA", "nodeB", "?"]
    for _ in range(MAX_RERUNS - 1):
        reruns.record(_running(0), e, "read", "nodeA")
    with pytest.raises(TaskLostError, match=r"partition\(s\) \[0\]"):
        reruns.record(_running(0), e, "read", "nodeA")


def test_stats_and_the_stall_report_name_what_was_lost():
    stats = ExecutionStats(rerun_partitions=3, lost_nodes=["abcdef0123456789"])
    assert "lost node(s) abcdef012345; 3 partition(s) re-run elsewhere; 0 coordinator(s) rebuilt" in str(stats)
    stalls = StallStats(batches=5)
    stalls.note_failures(stats, rebuilt=1)
    assert "lost node(s) abcdef012345; 3 partition(s) re-run elsewhere; 1 coordinator(s) rebuilt" in str(stalls)
    quiet = StallStats(batches=5)
    quiet.note_failures(ExecutionStats())
    assert "failures" not in str(quiet)


class _Log:
    def __init__(self, left: bool = False) -> None:
        self.left = left


class _Epoch:
    """The coordinator's epoch as the check sees it: per-rank logs, ``done``, the spec's epoch."""

    def __init__(self, done: set, left: set = frozenset()) -> None:
        self.logs = [_Log(r in left) for r in range(3)]
        self._done = done
        self.spec = type("Spec", (), {"epoch": 2})()

    def done(self, rank: int) -> bool:
        return rank in self._done


def test_a_rank_whose_process_is_gone_mid_share_fails_the_others_naming_its_node(monkeypatch):
    from sbloader.core.errors import SbloaderError
    from sbloader.distributed import job_watch
    from sbloader.distributed.job_watch import JobWatch, check_ranks_alive

    dead = {"job-b"}
    monkeypatch.setattr(job_watch, "job_alive", lambda d: d not in dead)
    watch = JobWatch()
    for r, (d, n) in enumerate([("job-a", "node-a"), ("job-b", "node-b"), ("job-c", "node-c")]):
        assert watch.claim(r, d, n) is None
    assert watch.gone(now=100.0) == [1]
    with pytest.raises(SbloaderError, match="epoch 2: the process of rank 1 on node node-b is gone"):
        check_ranks_alive(watch, _Epoch(done=set()), asking=0)
    check_ranks_alive(watch, _Epoch(done={1}), asking=0)  # it had its whole share: the end of a job
    check_ranks_alive(watch, _Epoch(done=set(), left={1}), asking=0)  # it left the epoch (a step limit)
    check_ranks_alive(watch, _Epoch(done=set()), asking=1)


def test_the_node_watch_names_a_node_that_left_once_and_says_when_one_joined(caplog):
    stats = ExecutionStats()
    reruns = Reruns(1, stats)

    def nodes(*alive):
        return [{"NodeID": n, "Alive": True} for n in alive] + [{"NodeID": "old", "Alive": False}]

    with caplog.at_level(logging.INFO, logger="sbloader.executor.reruns"):
        assert reruns.watch_nodes(now=10.0, nodes=nodes("a", "b")) is False  # the first look: nothing to compare
        assert reruns.watch_nodes(now=10.5, nodes=nodes("a")) is False  # within the poll interval: not looked at
        assert reruns.watch_nodes(now=13.0, nodes=nodes("a")) is False
        assert stats.lost_nodes == ["b"]
        assert reruns.watch_nodes(now=16.0, nodes=nodes("a", "c")) is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "lost node b" in warnings[0]
    assert len(infos) == 1 and "node c joined" in infos[0]
    # the same node, also lost by a call of ours: no second line
    e = ray.exceptions.ActorUnavailableError("unreachable", b"a" * 16)
    with caplog.at_level(logging.WARNING, logger="sbloader.executor.reruns"):
        caplog.clear()
        reruns.record(_running(1), e, "read", "b")
    assert not caplog.records and stats.lost_nodes == ["b"]
