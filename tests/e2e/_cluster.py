"""A real cluster started with the ``ray`` CLI, as docs/multinode.md tells users to, for the e2e tests.

A head (``ray start --head``) and CPU nodes (``ray start --address``), all on 127.0.0.1
with their own ports and temp dirs, stopped by pid (never ``ray stop``: other Rays on
this machine live on). Jobs join with ``RAY_ADDRESS`` and token authentication (Ray's
default), as the quick start's commands do. A node runs Ray's CLI through
``tests/scripts/ray_cli.py``, which only keeps its loopback address (see there).
Also what a fresh driver sees of the cluster: its live nodes, its leftover actors.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ray_logs import drop_dead_workers_logs
from sbloader.runtime.session import LOG_MONITOR_ENV

RAY_CLI = Path(__file__).resolve().parents[1] / "scripts" / "ray_cli.py"


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _procs_by_parent() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tree(roots: list[int]) -> list[int]:
    children = _procs_by_parent()
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _ray_daemons(marker: str) -> list[int]:
    """The daemons (gcs, raylets, monitors) whose command line names ``marker`` (a node's temp dir)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(int(p))]


def _ray_daemons_of_port(port: int) -> list[int]:
    """The daemons whose command line names the GCS port ``port`` as a whole number (``:4123`` is not in
    ``:41234``: a substring match took another session's daemons for this cluster's)."""
    ours = re.compile(rf":{port}(?!\d)")
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and ours.search(_cmdline(int(p)))]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# The head's GCS checks each raylet every second and counts a node dead after 3 failed checks in a row (Ray's
# defaults, 3 s and 5, take ~15 s: a test that kills a node waited that long for its blocks to be made again).
# A check times out after Ray's default 10 s, so a raylet alive but slow on this loaded machine is not taken for
# dead; a killed one refuses the check at once. docs/multinode.md gives users the same settings.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
# Every raylet keeps a worker idle above its soft limit (its CPUs) for 60 s, not Ray's 1 s: the task workers of
# an epoch otherwise go between epochs and the next epoch waits for new ones (docs/multinode.md, as the embedded Ray).
KEEP_IDLE_WORKERS = {"RAY_idle_worker_killing_time_threshold_ms": "60000"}
# The raylet a job's first driver joins starts no idle workers for it (one per CPU otherwise: 12 on test_resume's
# head, ~1 CPU-s each, most never given a task): the first tasks start the workers they need, as in the embedded
# Ray (``prestart_worker_first_driver`` in sbloader/runtime/session.py). Nor at its own start, nor for a lease
# request with a backlog (``enable_worker_prestart``: a 4-CPU head started 2 idle workers before any driver came;
# measured with ``ray start``, 3 worker processes against 1). The suite is CPU-bound (issue #48).
NO_PRESTART = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0"}


class Cluster:
    """The head and the CPU nodes: address, env for jobs, and the pids to stop.

    Args:
        head_cpus: the head's CPUs (the ranks run there).
        nodes: CPUs of each node joined with ``ray start --address`` (the first gets the
            custom resource ``node2``).
    """

    def __init__(self, head_cpus: int = 4, nodes: tuple = (4,)) -> None:
        self._stopped = threading.Event()  # first: stop() sets it, whatever else __init__ got to
        self.root = tempfile.mkdtemp(prefix="sbrc", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        base["RAY_USAGE_STATS_ENABLED"] = "0"
        base.update(KEEP_IDLE_WORKERS, **NO_PRESTART, **LOG_MONITOR_ENV)  # every node's log monitor as the embedded Ray's
        self.env = base
        self.raylets_before = set(self._raylets())
        self.node_raylets: dict[str, set] = {}  # node id -> its raylet's pid(s), for every node but the head
        head = subprocess.run(
            ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={head_cpus}",
             "--include-dashboard=false", f"--temp-dir={self.root}/head"],
            env=dict(base, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **HEALTH_CHECKS), capture_output=True, text=True,
            timeout=120)
        assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
        threading.Thread(target=self._prune_logs, daemon=True, name="cluster-logs").start()
        # Only this head's: a raylet another session started meanwhile (the other xdist group's embedded
        # Ray) was taken for the head's, and stop() SIGKILLed it under that session's test.
        self.head_raylet = (set(self._raylets()) & set(_ray_daemons(f"{self.root}/head"))) - self.raylets_before
        try:
            for k, cpus in enumerate(nodes):
                node_id = self.add_node(cpus, '{"node2": 1}' if k == 0 else None)
                if k == 0:
                    self.node2_raylet = set(self.node_raylets[node_id])
        except BaseException:  # the caller gets no Cluster to stop: stop what started
            self.stop()
            raise

    def add_node(self, cpus: int, resources: str | None = None, temp_dir: str | None = None) -> str:
        """Join one more node with ``ray start --address``; returns its node id. ``temp_dir``: its own
        session and log directory, as on another machine (by default it shares the head's)."""
        known = set(self._raylets())
        extra = ([f"--resources={resources}"] if resources else []) + ([f"--temp-dir={temp_dir}"] if temp_dir else [])
        node = subprocess.run(
            [sys.executable, str(RAY_CLI), "start", f"--address={self.address}", "--node-ip-address=127.0.0.1",
             f"--num-cpus={cpus}", *extra, "--dashboard-agent-listen-port=0", "--metrics-export-port=0"],
            env=dict(self.env, RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=120)
        assert node.returncode == 0, node.stdout[-2000:] + node.stderr[-2000:]
        ours = set(_ray_daemons_of_port(self.port))  # other sessions' Rays may start nodes meanwhile
        new = (set(self._raylets()) & ours) - known - self.head_raylet
        ids = {_node_id_of(p) for p in new}
        assert len(ids) == 1, f"expected one new raylet, found {new}"
        node_id = ids.pop()
        self.node_raylets[node_id] = new
        return node_id

    def _raylets(self) -> list[int]:
        return [p for p in _ray_daemons("raylet_socket_name") if "/raylet " in _cmdline(p) or
                _cmdline(p).split(" ", 1)[0].endswith("/raylet")]

    def kill_node2(self) -> None:
        """SIGKILL every process of the first CPU node (the one with the ``node2`` resource)."""
        _kill(_tree(sorted(self.node2_raylet)))

    def kill_node(self, node_id: str) -> None:
        """SIGKILL every process of a node: its raylet and everything it started (workers, agents)."""
        _kill(_tree(sorted(self.node_raylets[node_id])))

    def _prune_logs(self) -> None:
        """Every 5 s until the cluster stops, the exited workers' log files of every node's session
        deleted (:mod:`ray_logs`: each node's log monitor looks at every file ten times a second)."""
        while not self._stopped.wait(5.0):
            for logs in glob.glob(f"{self.root}/*/session_2*/logs"):
                drop_dead_workers_logs(logs)

    def stop(self) -> None:
        self._stopped.set()
        raylets = set(self.head_raylet).union(*self.node_raylets.values())
        daemons = _ray_daemons(self.root) + _ray_daemons_of_port(self.port) + sorted(raylets)
        _kill(sorted(set(_tree(daemons))))
        shutil.rmtree(self.root, ignore_errors=True)


def _node_id_of(raylet_pid: int) -> str:
    for arg in _cmdline(raylet_pid).split():
        if arg.startswith("--node_id="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"raylet {raylet_pid} has no --node_id: {_cmdline(raylet_pid)[:300]}")


def _fresh_driver(cluster: Cluster, code: str, marker: str):
    """Run ``code`` in a fresh driver joined to the cluster; the JSON of its last line starting with ``marker``."""
    code = "import json, ray, sbloader; sbloader.init(address='%s'); " % cluster.address + code
    proc = subprocess.run([sys.executable, "-c", code], env=cluster.env, capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(marker)]
    assert lines, proc.stderr[-2000:]
    return json.loads(lines[-1])


def leftovers(cluster: Cluster) -> dict:
    """Live actors and placement groups on the cluster, seen by a fresh driver."""
    return _fresh_driver(cluster, (
        "from ray._private.state import state; "
        "actors = [a['ActorClassName'] for a in state.actor_table(None).values() if a['State'] != 'DEAD']; "
        "pgs = [p for p in ray.util.placement_group_table().values() if p['state'] != 'REMOVED']; "
        "print(json.dumps({'actors': actors, 'pgs': len(pgs)}))"), "{")


def alive_nodes(cluster: Cluster) -> list:
    """Ids of the nodes the cluster's GCS counts alive, seen by a fresh driver."""
    return _fresh_driver(cluster, "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))", "[")


def wait_no_leftovers(cluster: Cluster, within_s: float = 30) -> dict:
    """The cluster's leftovers (:func:`leftovers`) once none is left, or after ``within_s`` seconds
    (a job's actors and placement groups are released as its drivers exit)."""
    deadline = time.monotonic() + within_s
    left = leftovers(cluster)
    while (left["actors"] or left["pgs"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        left = leftovers(cluster)
    return left
