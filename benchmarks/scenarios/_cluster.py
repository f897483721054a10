"""A real Ray cluster started with the ``ray`` CLI on this machine, as docs/multinode.md
tells users to: a head (``ray start --head``) and a second node (``ray start --address``
through ``tests/scripts/ray_cli.py``, which keeps a loopback address), each on
127.0.0.1 with its own ports, stopped by pid. As ``tests/e2e/test_ray_cluster.py``."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from benchmarks.harness import ROOT, cmdline, descendants

RAY_CLI = ROOT / "tests" / "scripts" / "ray_cli.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_naming(marker: str) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and marker in cmdline(int(p))}


def _raylets() -> set[int]:
    return {p for p in _pids_naming("raylet_socket_name") if cmdline(p).split(" ", 1)[0].endswith("/raylet")}


class Cluster:
    """The head and the second node: ``address``, ``env`` for jobs, the pids to stop."""

    def __init__(self, cpus_per_node: int = 2) -> None:
        self.root = tempfile.mkdtemp(prefix="sbbn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_USAGE_STATS_ENABLED="0", RAY_health_check_failure_threshold="30",
                        PYTHONPATH=os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
        before = _raylets()
        self._run(["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                   f"--num-cpus={cpus_per_node}", "--include-dashboard=false", f"--temp-dir={self.root}/head"],
                  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        self.head = _raylets() - before
        self._run([sys.executable, str(RAY_CLI), "start", f"--address={self.address}", "--node-ip-address=127.0.0.1",
                   f"--num-cpus={cpus_per_node}", '--resources={"node2": 1}', "--dashboard-agent-listen-port=0",
                   "--metrics-export-port=0"], RAY_AUTH_MODE="token")
        self.node2 = _raylets() - before - self.head

    def _run(self, cmd: list[str], **env: str) -> None:
        r = subprocess.run(cmd, env=dict(self.env, **env), capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"{' '.join(cmd[:3])} failed: {(r.stdout + r.stderr)[-600:]}")

    def daemons(self) -> set[int]:
        """Every process of the cluster now."""
        return descendants(_pids_naming(self.root) | _pids_naming(f":{self.port}") | self.head | self.node2)

    def kill_node2(self) -> None:
        """The second node's raylet and everything under it, at once (a machine lost)."""
        for pid in sorted(descendants(self.node2)):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def stop(self) -> None:
        """Kill the cluster's processes by pid; remove its folder."""
        for pid in sorted(self.daemons()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
