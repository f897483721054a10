"""The e2e cluster helper stops its own processes only: the tests run in two xdist groups side by side,
so another session's Ray (the ``ray/`` group's scripts start their own) starts raylets while a cluster
here starts and stops."""
from __future__ import annotations

import subprocess
import sys

import _cluster
from _cluster import Cluster, free_port


def test_a_raylet_another_session_starts_during_the_head_start_is_not_the_clusters(tmp_path, monkeypatch):
    """A raylet of another session that appears while ``ray start --head`` runs is neither taken for the
    head's nor killed by ``stop()`` (it was: CI's ``ray/`` group lost its embedded Ray's node mid-test,
    "health check failed", when an e2e cluster stopped); nor is a daemon whose GCS port only begins with
    this cluster's (``:4123`` in ``:41234``)."""
    fake = tmp_path / "raylet"
    fake.symlink_to(sys.executable)  # its command line reads as a raylet's
    others: list = []
    real_run = subprocess.run

    def run(cmd, *a, **k):
        if "--head" in cmd and not others:  # another session's raylet starts meanwhile
            others.append(subprocess.Popen(
                [str(fake), "-c", "import time; time.sleep(120)", f"--raylet_socket_name={tmp_path}/sockets/raylet",
                 "--node_id=" + "ab" * 28, f"--gcs-address=127.0.0.1:{port}1"]))
        return real_run(cmd, *a, **k)

    port = free_port()
    monkeypatch.setattr(_cluster, "free_port", lambda: port)
    monkeypatch.setattr(_cluster.subprocess, "run", run)
    c = Cluster(head_cpus=1, nodes=())
    try:
        assert others and others[0].pid in c._raylets(), "the stand-in raylet did not start"
        assert others[0].pid not in c.head_raylet and c.head_raylet, c.head_raylet
    finally:
        c.stop()
    try:
        assert others[0].poll() is None, "the cluster's stop killed another session's raylet"
    finally:
        others[0].kill()
        others[0].wait()
