"""The embedded Ray's start once more when its node timed out during startup (Ray 2.60's raylet aborts
when its dashboard agent is slower than 15 s to write its ports: CI's 2 cores under both test groups)."""
from __future__ import annotations

import pytest
import ray

from sbloader.runtime import session


def test_a_node_that_timed_out_during_startup_is_started_once_more(monkeypatch):
    stopped, calls = [], []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(1))

    def start():
        calls.append(1)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")
        return "127.0.0.1:1234"

    assert session.start_node_twice(start) == "127.0.0.1:1234"
    assert (len(calls), len(stopped)) == (2, 1)  # the failed start's processes stopped before the second


def test_other_start_errors_and_a_second_time_out_are_raised(monkeypatch):
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    calls = []

    def refused():
        calls.append(1)
        raise ValueError("bad num_cpus")

    with pytest.raises(ValueError, match="bad num_cpus"):
        session.start_node_twice(refused)
    assert len(calls) == 1

    def always():
        calls.append(1)
        raise Exception("The current node timed out during startup.")

    with pytest.raises(Exception, match="timed out during startup"):
        session.start_node_twice(always)
    assert len(calls) == 3
