"""Simulated ranks against the real split coordinator (sbloader/distributed/simulate.py), at 32 ranks."""
from __future__ import annotations

import pytest

from sbloader.distributed.simulate import SimConfig, check, simulate


@pytest.mark.parametrize("in_order", [True, False])
def test_32_ranks_take_equal_counts_exactly_once(ray_session, in_order: bool) -> None:
    cfg = SimConfig(32, per_rank=12, rate=20.0, in_order=in_order, nodes=4, name=f"sim-eq-{in_order}")
    out = simulate(cfg, hosts=1, lead_s=0.5)
    assert out["errors"] == []
    assert out["check"]["equal_counts"] and out["check"]["exactly_once"], out["check"]
    # leases: once a rank knows its pace (20/s), one request carries several batches
    assert out["requests"] < out["batches"] / 2
    # the ledger holds runs, not batches: an in-order rank's log is one run
    if in_order:
        # (plus each rank's unacknowledged batches' sizes, at most two leases)
        assert out["ledger_bytes"] < 110 * 32
    assert out["state_bytes"] < 100  # every batch consumed: one range


def test_a_coordinator_killed_mid_epoch_is_rebuilt_from_the_ranks_logs(ray_session) -> None:
    # 36 batches at 12/s: at the kill (1 s in) no rank can hold all of its batches (at most
    # 12 taken + two leases of 8), so every rank has a request in flight and notices
    cfg = SimConfig(32, per_rank=36, rate=12.0, name="sim-kill", rebuild_timeout_s=60.0)
    out = simulate(cfg, hosts=1, kill_after_s=1.0, lead_s=0.5)
    assert out["killed"] and out["errors"] == [], out["errors"]
    assert out["check"]["equal_counts"] and out["check"]["exactly_once"], out["check"]
    # every rank had a reply from the new coordinator
    assert out["rebuild_s"] is not None, (out["rebuild_phases_s"], out["noticed_by"])


def test_the_check_catches_a_duplicate_and_a_loss() -> None:
    cfg = SimConfig(2, per_rank=2)
    assert check([{"taken": [0, 2]}, {"taken": [1, 3]}], cfg)["exactly_once"]
    bad = check([{"taken": [0, 2]}, {"taken": [1, 2]}], cfg)
    assert bad == {"counts": [2], "equal_counts": True, "duplicates": 1, "missing": 1, "exactly_once": False}
    assert not check([{"taken": [0, 2, 3]}, {"taken": [1]}], cfg)["equal_counts"]
