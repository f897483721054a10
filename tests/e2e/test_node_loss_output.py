"""What a user reads after one CPU node's death: one line (issue #46).

A ``ray start`` cluster as docs/multinode.md's quick start (a head with 1 CPU that
trains, two CPU nodes of 2 CPUs), each node with its own session and log directory
as on separate machines (nodes of one machine share the head's by default: each
node's log monitor then forwards every worker's line once more). A 2-rank torchrun
drop-in job (``tests/scripts/node_loss_job.py``, a MapActor pool) loses the node
that made most of its batches after 8 batches. In the drivers' captured output:
exactly one ``lost node`` line, no Ray retry chatter (``There are N retries
remaining``), no ``InvalidAuthToken`` line, and the job exits 0 with every sample
exactly once per epoch.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from test_ray_cluster import NODE_LOSS_JOB, ROWS, Cluster, _epochs_of, _progress, _torchrun, _wait


@pytest.fixture
def separate_logs_cluster():
    c = Cluster(head_cpus=1, nodes=())
    try:
        for k in range(2):
            c.add_node(2, temp_dir=f"{c.root}/node{k}")
        yield c
    finally:
        c.stop()


def kill_busiest_node_after(cluster: Cluster, out: Path, procs: list, batches: int) -> str:
    """Wait for ``batches`` batches of epoch 0, then SIGKILL the CPU node that made most of them."""
    deadline = time.monotonic() + 240
    while sum(1 for b in _progress(out) if b["epoch"] == 0) < batches:
        assert time.monotonic() < deadline, "the job made no progress"
        assert all(p.poll() is None for p in procs), "a rank exited early"
        time.sleep(0.2)
    ran: dict[str, int] = {}
    for b in _progress(out):
        for n in b["nodes"]:
            ran[n] = ran.get(n, 0) + 1
    victim = max((n for n in ran if n in cluster.node_raylets), key=lambda n: ran[n])
    cluster.kill_node(victim)
    return victim


def test_one_node_loss_is_one_warning_line_and_no_ray_retry_chatter(separate_logs_cluster, tmp_path):
    procs = _torchrun(separate_logs_cluster, tmp_path, "--mode", "dropin", script=NODE_LOSS_JOB)
    try:
        victim = kill_busiest_node_after(separate_logs_cluster, tmp_path, procs, 8)
        out = _wait(procs, timeout=420)
        (tmp_path / "output.txt").write_text(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for ranks in _epochs_of(tmp_path):
        assert sorted(i for r in ranks for i in r["ids"]) == list(range(ROWS)), "every sample exactly once per epoch"
        assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]), "equal counts on every rank"
    lost = [line for line in out.splitlines() if "lost node" in line]
    assert len(lost) == 1 and victim in lost[0], f"{len(lost)} 'lost node' lines for one node's death:\n" + \
        "\n".join(lost)
    chatter = [line for line in out.splitlines() if "retries remaining" in line]
    assert not chatter, f"Ray's retry chatter reached the user ({len(chatter)} lines): {chatter[:3]}"
    auth = [line for line in out.splitlines() if "InvalidAuthToken" in line]
    assert not auth, f"the join printed {len(auth)} InvalidAuthToken line(s): {auth[:2]}"
