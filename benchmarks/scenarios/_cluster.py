"""A real Ray cluster started with the ``ray`` CLI on this machine, as docs/multinode.md
tells users to: a head (``ray start --head``) and CPU nodes (``ray start --address``
through ``tests/scripts/ray_cli.py``, which keeps a loopback address), each on
127.0.0.1 with its own ports, stopped by pid. As ``tests/e2e/test_ray_cluster.py``.

Each CPU node keeps its own session and log directory (``--temp-dir``), as on
separate machines: nodes of one machine share the head's by default, and then every
node's log monitor forwards each worker's line once more to the drivers.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Optional

from benchmarks.harness import ROOT, ProcTree, cmdline, descendants

RAY_CLI = ROOT / "tests" / "scripts" / "ray_cli.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_naming(marker: str) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and marker in cmdline(int(p))}


def cluster_tree(cluster: "Cluster") -> ProcTree:
    """The processes a cluster scenario accounts for: this one's tree and every daemon of the cluster
    (each names the cluster's temp directory), so a quiet machine's rounds are marked quiet."""
    return ProcTree(also=lambda: _pids_naming(cluster.root))


def _raylets() -> set[int]:
    return {p for p in _pids_naming("raylet_socket_name") if cmdline(p).split(" ", 1)[0].endswith("/raylet")}


def _node_id(raylet: int) -> str:
    for arg in cmdline(raylet).split():
        if arg.startswith("--node_id="):
            return arg.split("=", 1)[1]
    raise RuntimeError(f"raylet {raylet} has no --node_id")


class Cluster:
    """The head and the CPU nodes: ``address``, ``env`` for jobs, the pids to stop.

    Args:
        head_cpus: the head's CPUs (the ranks, or the driver, run there).
        nodes: CPUs of each CPU node joined at the start (the first gets the custom
            resource ``node2``).
        own_logs: each CPU node its own temp (session, log) directory.
    """

    def __init__(self, head_cpus: int = 2, nodes: tuple = (2,), own_logs: bool = True) -> None:
        self.root = tempfile.mkdtemp(prefix="sbbn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.own_logs = own_logs
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_USAGE_STATS_ENABLED="0",
                        PYTHONPATH=os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
        self.nodes: dict[str, set] = {}  # CPU node id -> its raylet pid(s), while alive
        self.killed: list[str] = []
        before = _raylets()
        self._run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                   f"--num-cpus={head_cpus}", "--include-dashboard=false", f"--temp-dir={self.root}/head"],
                  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        self.head = (_raylets() & _pids_naming(f"{self.root}/head")) - before  # not another session's raylet
        self.head_id = _node_id(min(self.head))
        for k, cpus in enumerate(nodes):
            node = self.add_node(cpus, '{"node2": 1}' if k == 0 else None)
            if k == 0:
                self.node2 = set(self.nodes[node])

    def start_node(self, cpus: int, resources: Optional[str] = None) -> subprocess.Popen:
        """Begin joining one more node (``ray start --address``); :meth:`joined` waits for it."""
        self._count = getattr(self, "_count", 0) + 1
        extra = [f"--resources={resources}"] if resources else []
        if self.own_logs:
            extra.append(f"--temp-dir={self.root}/n{self._count}")
        self._known = _raylets()
        return subprocess.Popen(
            [sys.executable, str(RAY_CLI), "start", f"--address={self.address}", "--node-ip-address=127.0.0.1",
             f"--num-cpus={cpus}", *extra, "--dashboard-agent-listen-port=0", "--metrics-export-port=0"],
            env=dict(self.env, RAY_AUTH_MODE="token"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def joined(self, proc: subprocess.Popen, known: Optional[set] = None) -> str:
        """Wait for a node begun by :meth:`start_node`; its node id."""
        out = proc.communicate(timeout=180)[0]
        if proc.returncode != 0:
            raise RuntimeError(f"ray start --address failed: {out[-600:]}")
        ours = _pids_naming(f":{self.port}")  # other sessions' Rays may start nodes meanwhile
        new = (_raylets() & ours) - (known if known is not None else self._known) - self.head
        new -= set().union(*self.nodes.values()) if self.nodes else set()
        ids = {_node_id(p) for p in new}
        if len(ids) != 1:
            raise RuntimeError(f"expected one new raylet, found {sorted(new)}")
        node = ids.pop()
        self.nodes[node] = new
        return node

    def add_node(self, cpus: int, resources: Optional[str] = None) -> str:
        """Join one more node; its node id."""
        known = _raylets()
        return self.joined(self.start_node(cpus, resources), known)

    def kill_node(self, node: str) -> None:
        """SIGKILL every process of a CPU node at once: its raylet and everything under it (a machine lost)."""
        for pid in sorted(descendants(self.nodes.pop(node))):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.killed.append(node)

    def _run(self, cmd: list[str], **env: str) -> None:
        r = subprocess.run(cmd, env=dict(self.env, **env), capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"{' '.join(cmd[:3])} failed: {(r.stdout + r.stderr)[-600:]}")

    def daemons(self) -> set[int]:
        """Every process of the cluster now."""
        raylets = set(self.head).union(*self.nodes.values()) if self.nodes else set(self.head)
        return descendants(_pids_naming(self.root) | _pids_naming(f":{self.port}") | raylets)

    def stop(self) -> None:
        """Kill the cluster's processes by pid; remove its folder."""
        for pid in sorted(self.daemons()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
