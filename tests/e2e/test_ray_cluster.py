"""A real cluster started with the ``ray`` CLI, as docs/multinode.md tells users to.

A head (``ray start --head``) and a second node (``ray start --address``), both on
127.0.0.1 with their own ports and temp dirs, stopped by pid at the end. Jobs
join with ``RAY_ADDRESS`` and token authentication (Ray's default), as the
quick start's commands do. The second node runs Ray's CLI through
``tests/scripts/ray_cli.py``, which only keeps its loopback address (see there).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "scripts" / "cluster_job.py"
RAY_TRAIN_JOB = HERE.parent / "scripts" / "raytrain_job.py"
RAY_CLI = HERE.parent / "scripts" / "ray_cli.py"
ROWS = 480


def _free_port() -> int:
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
    """The daemons (gcs, raylets, monitors) whose command line names ``marker`` (a node's temp dir or port)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(int(p))]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Cluster:
    """The head and the CPU nodes: address, env for jobs, and the pids to stop.

    Args:
        head_cpus: the head's CPUs (the ranks run there).
        nodes: CPUs of each node joined with ``ray start --address`` (the first gets the
            custom resource ``node2``).
    """

    def __init__(self, head_cpus: int = 4, nodes: tuple = (4,)) -> None:
        self.root = tempfile.mkdtemp(prefix="sbrc", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        base["RAY_USAGE_STATS_ENABLED"] = "0"
        self.env = base
        self.raylets_before = set(self._raylets())
        self.node_raylets: dict[str, set] = {}  # node id -> its raylet's pid(s), for every node but the head
        head = subprocess.run(
            ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", f"--num-cpus={head_cpus}",
             "--include-dashboard=false", f"--temp-dir={self.root}/head"],
            env=dict(base, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"), capture_output=True, text=True, timeout=120)
        assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
        self.head_raylet = set(self._raylets()) - self.raylets_before
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
        ours = set(_ray_daemons(f":{self.port}"))  # other sessions' Rays may start nodes meanwhile
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
        _kill(_tree(sorted(self.node2_raylet)))

    def kill_node(self, node_id: str) -> None:
        """SIGKILL every process of a node: its raylet and everything it started (workers, agents)."""
        _kill(_tree(sorted(self.node_raylets[node_id])))

    def stop(self) -> None:
        raylets = set(self.head_raylet).union(*self.node_raylets.values())
        daemons = _ray_daemons(self.root) + _ray_daemons(f":{self.port}") + sorted(raylets)
        _kill(sorted(set(_tree(daemons))))
        shutil.rmtree(self.root, ignore_errors=True)


def _node_id_of(raylet_pid: int) -> str:
    for arg in _cmdline(raylet_pid).split():
        if arg.startswith("--node_id="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"raylet {raylet_pid} has no --node_id: {_cmdline(raylet_pid)[:300]}")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


def _torchrun(cluster: Cluster, out: Path, *args: str, env: dict | None = None, script: Path = JOB) -> list:
    """Two torchrun agents of one rank each (two machines of one GPU in docs/multinode.md), one job."""
    rdzv = _free_port()
    procs = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}",
               f"--rdzv-id=job-{out.name}", "--max-restarts=0", str(script), "--out", str(out), *args]
        procs.append(subprocess.Popen(cmd, env=dict(cluster.env, RAY_ADDRESS=cluster.address, **(env or {})),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _wait(procs: list, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    out = ""
    for p in procs:
        try:
            out += p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] or ""
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the job hung for {timeout:.0f} s")
        assert p.returncode == 0, f"a rank failed (rc {p.returncode}):\n{out[-4000:]}"
    return out


def _epochs(out: Path) -> list[list[dict]]:
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for log in logs:
        assert log["info"]["embedded"] is False and log["info"]["address"].startswith("127.0.0.1:")
    return [[log["epochs"][e] for log in logs] for e in range(len(logs[0]["epochs"]))]


def _leftovers(cluster: Cluster) -> dict:
    """Live actors and placement groups on the cluster, seen by a fresh driver."""
    code = ("import json, ray, sbloader; sbloader.init(address='%s'); "
            "from ray._private.state import state; "
            "actors = [a['ActorClassName'] for a in state.actor_table(None).values() if a['State'] != 'DEAD']; "
            "pgs = [p for p in ray.util.placement_group_table().values() if p['state'] != 'REMOVED']; "
            "print(json.dumps({'actors': actors, 'pgs': len(pgs)}))") % cluster.address
    proc = subprocess.run([sys.executable, "-c", code], env=cluster.env,
                          capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, proc.stderr[-2000:]
    return json.loads(lines[-1])


def test_two_rank_job_joins_with_ray_address_reads_on_both_nodes_and_leaves_nothing(cluster, tmp_path):
    _wait(_torchrun(cluster, tmp_path))
    for ranks in _epochs(tmp_path):
        ids = [i for r in ranks for i in r["ids"]]
        assert sorted(ids) == list(range(ROWS)), "every sample exactly once per epoch"
        assert len(ranks[0]["ids"]) == len(ranks[1]["ids"])
        assert len({n for r in ranks for n in r["nodes"]}) == 2, "blocks came from one node only"
    deadline = time.monotonic() + 30
    left = _leftovers(cluster)
    while (left["actors"] or left["pgs"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        left = _leftovers(cluster)
    assert left == {"actors": [], "pgs": 0}, f"the job left this on the cluster: {left}"


def _fails_fast(cluster: Cluster, env: dict, expect: str) -> None:
    """The first use of sbloader fails with ``expect`` within seconds (timed from the call, after the imports).

    The bound is 30 s: sbloader's own checks answer within their 5 s connect timeout on a
    quiet machine, and the behaviour checked is an error instead of a hang; 30 s keeps that
    on a machine loaded many times over (10 s measured the load, not the behaviour)."""
    code = ("import sys, time, sbloader\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            "    sum(1 for _ in sbloader.range(10).iter_batches(batch_size=5))\n"
            "finally:\n"
            "    print('TOOK', time.monotonic() - t0, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(cluster.env, **env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert expect in proc.stderr, proc.stderr[-3000:]
    took = float(proc.stderr.split("TOOK ")[1].split()[0])
    assert took < 30, f"failed after {took:.1f} s"


def test_a_wrong_token_fails_within_seconds_saying_how_to_give_it(cluster):
    _fails_fast(cluster, {"RAY_ADDRESS": cluster.address, "RAY_AUTH_TOKEN": "not-the-token"},
                "refused this process's authentication token")


def test_an_unreachable_address_fails_within_seconds_naming_it(cluster):
    port = _free_port()
    _fails_fast(cluster, {"RAY_ADDRESS": f"127.0.0.1:{port}"}, f"no Ray cluster answers at 127.0.0.1:{port}")


def test_a_ray_client_address_is_refused_at_once(cluster):
    _fails_fast(cluster, {"RAY_ADDRESS": "ray://127.0.0.1:10001"}, "Ray Client")


# ----- several jobs on one cluster (issue #27): each its own coordinator, never shared ------------------------------


def _static_torchrun(cluster: Cluster, out: Path, rows: int) -> subprocess.Popen:
    """``torchrun --nproc-per-node=2`` with the static rendezvous: its run id is "none", as for every such job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           f"--master-port={_free_port()}", "--max-restarts=0", str(JOB), "--out", str(out), "--rows", str(rows),
           "--delay", "0.02"]
    return subprocess.Popen(cmd, env=dict(cluster.env, RAY_ADDRESS=cluster.address), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_two_static_torchrun_jobs_at_once_each_get_all_their_data(cluster, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _wait([_static_torchrun(cluster, a, 240), _static_torchrun(cluster, b, 160)])
    for out, rows in ((a, 240), (b, 160)):
        for ranks in _epochs(out):
            assert sorted(i for r in ranks for i in r["ids"]) == list(range(rows))


@pytest.mark.parametrize("sizes", [(240, 240), (240, 120)])
def test_two_ray_train_jobs_at_once_each_get_all_their_data(cluster, tmp_path, sizes):
    pytest.importorskip("ray.train.torch")
    procs, outs = [], []
    for k, n in enumerate(sizes):
        out = tmp_path / f"job{k}"
        out.mkdir()
        outs.append((out, n))
        procs.append(subprocess.Popen([sys.executable, str(RAY_TRAIN_JOB), str(out), str(n)],
                                      env=dict(cluster.env, RAY_ADDRESS=cluster.address),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    _wait(procs, timeout=420)
    for out, n in outs:
        ranks = [json.loads((out / f"rank{r}.json").read_text())["epochs"] for r in range(2)]
        for e in range(2):
            assert len(ranks[0][e]) == len(ranks[1][e])
            assert sorted(ranks[0][e] + ranks[1][e]) == list(range(n)), f"job {out.name} epoch {e}"


# ----- a CPU node lost, and one added, mid-epoch (issue #35) --------------------------------------------------------

NODE_LOSS_JOB = HERE.parent / "scripts" / "node_loss_job.py"


@pytest.fixture(scope="module")
def small_cluster():
    """As docs/multinode.md's quick start: a head with 1 CPU that trains, two CPU nodes of 2 CPUs.

    Shared by the modes of the node-loss test (one cluster start instead of one per mode):
    each test kills a CPU node and adds one, so the shape stays a head and two CPU nodes;
    a test waits, before it ends, until the Ray has marked the killed node dead."""
    c = Cluster(head_cpus=1, nodes=(2, 2))
    try:
        yield c
    finally:
        c.stop()


def _alive_nodes(cluster: Cluster) -> list:
    """Ids of the nodes the cluster's GCS counts alive, seen by a fresh driver."""
    code = ("import json, ray, sbloader; sbloader.init(address='%s'); "
            "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))") % cluster.address
    proc = subprocess.run([sys.executable, "-c", code], env=cluster.env, capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[")]
    assert lines, proc.stderr[-2000:]
    return json.loads(lines[-1])


def _progress(out: Path) -> list[dict]:
    lines = []
    for r in range(2):
        path = out / f"progress{r}.jsonl"
        if path.exists():
            lines += [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
    return lines


@pytest.mark.parametrize("mode", ["dropin", "native"])
def test_a_cpu_node_killed_and_one_added_mid_epoch_every_rank_goes_on_exactly_once(small_cluster, tmp_path, mode):
    procs = _torchrun(small_cluster, tmp_path, "--mode", mode, script=NODE_LOSS_JOB)
    try:
        deadline = time.monotonic() + 240
        while sum(1 for b in _progress(tmp_path) if b["epoch"] == 0) < 8:  # a few batches, both nodes busy
            assert time.monotonic() < deadline, "the job made no progress"
            assert all(p.poll() is None for p in procs), "a rank exited early"
            time.sleep(0.2)
        ran: dict[str, int] = {}
        for b in _progress(tmp_path):
            for n in b["nodes"]:
                ran[n] = ran.get(n, 0) + 1
        victim = max((n for n in ran if n in small_cluster.node_raylets), key=lambda n: ran[n])
        small_cluster.kill_node(victim)
        killed_at = time.time()
        added = small_cluster.add_node(2)
        out = _wait(procs, timeout=420)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    epochs = _epochs_of(tmp_path)
    for ranks in epochs:
        assert sorted(i for r in ranks for i in r["ids"]) == list(range(ROWS)), "every sample exactly once per epoch"
        assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]), "equal counts on every rank"
    assert ran[victim] > 0, "the killed node ran work before the kill"
    after = [b for b in _progress(tmp_path) if b["t"] > killed_at]
    assert any(added in b["nodes"] for b in after), "the node added mid-epoch was never used"
    if mode == "dropin":
        # A native pipeline's read tasks are re-run by Ray itself: the loss is seen only by the
        # executor's node watch, which does not run once the epoch's reads are all done (the node
        # may be declared dead after that), so there the naming is not certain (issue #35's note).
        assert f"lost node {victim}" in out, "no warning named the lost node"
        assert any(f"lost node(s) {victim[:12]}" in r["stats"] for ranks in epochs for r in ranks), \
            "stats() did not name the lost node"
    deadline = time.monotonic() + 30
    left = _leftovers(small_cluster)
    while (left["actors"] or left["pgs"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        left = _leftovers(small_cluster)
    assert left == {"actors": [], "pgs": 0}, f"the job left this on the cluster: {left}"
    # the next mode runs on this cluster: wait until the killed node counts as dead (Ray's health checks)
    deadline = time.monotonic() + 180
    while victim in _alive_nodes(small_cluster):
        assert time.monotonic() < deadline, f"node {victim} still counted alive 180 s after its kill"
        time.sleep(2.0)


def _epochs_of(out: Path) -> list[list[dict]]:
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return [[log["epochs"][e] for log in logs] for e in range(len(logs[0]["epochs"]))]
