"""Where sbloader runs: the embedded local Ray, and a cluster it joins but never stops.

Each test runs its Ray in subprocesses of its own, never the session's shared Ray
(``tests/conftest.py``): the embedded Ray is one per process and is stopped at the
process's exit, which is what is checked here.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
import time

import pytest

import ray  # noqa: F401  - puts Ray's vendored psutil on sys.path

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")


def _env(**extra: str) -> dict:
    """A child's environment: loopback only, no cluster address, Ray's auth default."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    # A Ray started earlier in this pytest process may have set RAY_AUTH_MODE=token
    # here; the child must show that sbloader leaves token auth on by itself.
    env.pop("RAY_AUTH_MODE", None)
    env.update(extra)
    return env


def _run_child(script: str, env: dict, timeout: float = 90) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"child failed (rc {proc.returncode}):\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _alive(pid: int, create_time: float) -> bool:
    """The process ``pid`` started at ``create_time`` still exists (not a zombie, not a reused pid)."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.5 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _session_processes(session_name: str) -> list[int]:
    """Processes whose command line names the Ray session (its temp dir, its flags)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(session_name in a for a in (p.info["cmdline"] or [])) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


EMBEDDED_CHILD = """
import json
import sbloader


def pipeline(n):
    # no sbloader.init(): the first iteration starts the embedded Ray
    ds = sbloader.range(n, num_partitions=2).map(lambda r: {"id": r["id"] + 1})
    return sorted(int(r["id"]) for r in ds.iter_rows())


out = {"rows1": pipeline(10)}

import psutil
import ray
from ray._raylet import AuthenticationMode, get_authentication_mode
from ray.experimental import internal_kv

info = sbloader.init()  # idempotent: what the pipeline started
node = ray._private.worker.global_worker.node
out["info"] = {"address": info.address, "embedded": info.embedded}
out["gcs_address"] = ray.get_runtime_context().gcs_address
out["node_ip"] = node.node_ip_address
out["session_name"] = node.session_name
out["webui_url"] = node.address_info.get("webui_url")
out["webui_kv"] = (internal_kv._internal_kv_get("webui:url", namespace="dashboard") or b"").decode()
out["token_auth_driver"] = get_authentication_mode() == AuthenticationMode.TOKEN

procs = {}
for kind, infos in node.all_processes.items():
    for pinfo in infos:
        procs[pinfo.process.pid] = kind
raylet_pid = node.all_processes["raylet"][0].process.pid
for child in psutil.Process(raylet_pid).children(recursive=True):  # agents, workers
    procs.setdefault(child.pid, "raylet child")
out["procs"] = []
for pid, kind in procs.items():
    p = psutil.Process(pid)
    listen = [c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    out["procs"].append({"pid": pid, "kind": kind, "create_time": p.create_time(), "listen": listen,
                         "cmdline": p.cmdline(), "auth_mode": p.environ().get("RAY_AUTH_MODE")})

out["rows2"] = pipeline(12)  # a second pipeline: the same Ray, not a new one
out["gcs_address2"] = ray.get_runtime_context().gcs_address
out["raylet_pid2"] = ray._private.worker.global_worker.node.all_processes["raylet"][0].process.pid
out["info2"] = sbloader.init().address
print(json.dumps(out), flush=True)
# no sbloader.shutdown(): stopping the embedded Ray at exit is under test
"""


def test_embedded_ray_is_loopback_no_dashboard_token_auth_reused_and_gone_after_exit():
    out = _run_child(EMBEDDED_CHILD, _env())
    assert out["rows1"] == list(range(1, 11)) and out["rows2"] == list(range(1, 13))

    # loopback: the GCS address, the node's address and every listening socket
    assert out["info"]["embedded"] is True
    assert out["gcs_address"].startswith("127.0.0.1:"), out["gcs_address"]
    assert out["info"]["address"] == out["gcs_address"]
    assert out["node_ip"] == "127.0.0.1"
    listening = {(p["kind"], ip) for p in out["procs"] for ip in p["listen"]}
    assert any(kind == "gcs_server" for kind, _ in listening), listening  # the check sees sockets at all
    assert all(ip in LOOPBACK for _, ip in listening), f"a Ray process listens beyond loopback: {listening}"

    # no dashboard: no web UI URL, and Ray's API-server process (always started) runs
    # minimal, without the frontend, listening on no port
    assert not out["webui_url"] and not out["webui_kv"], (out["webui_url"], out["webui_kv"])
    dash = [p for p in out["procs"] if p["kind"] == "dashboard"]
    for p in dash:
        assert "--minimal" in p["cmdline"] and "--disable-frontend" in p["cmdline"], p["cmdline"]
        assert p["listen"] == [], f"the dashboard process serves {p['listen']}"

    # token authentication: on in the driver and in the GCS and raylet themselves
    assert out["token_auth_driver"]
    servers = [p for p in out["procs"] if p["kind"] in ("gcs_server", "raylet")]
    assert len(servers) == 2 and all(p["auth_mode"] == "token" for p in servers), servers

    # one Ray per process: the second pipeline ran on the first one's Ray
    assert out["gcs_address2"] == out["gcs_address"] == out["info2"]
    raylet = next(p for p in out["procs"] if p["kind"] == "raylet")
    assert out["raylet_pid2"] == raylet["pid"]

    # stopped at exit: every process of the session is gone within 10 s
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in out["procs"] if _alive(p["pid"], p["create_time"])]
        left_by_name = _session_processes(out["session_name"])
        if not left and not left_by_name:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"Ray processes outlived the driver: {[(p['kind'], p['pid']) for p in left]}, "
                        f"session {out['session_name']}: pids {left_by_name}")
        time.sleep(0.2)


HEAD_HOLDER = """
import json, sys
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
node = cluster.head_node
print(json.dumps({"address": cluster.address,
                  "gcs_pid": node.all_processes["gcs_server"][0].process.pid,
                  "raylet_pid": node.all_processes["raylet"][0].process.pid}), flush=True)
sys.stdin.read()  # hold the cluster until the test closes our stdin
cluster.shutdown()
"""

JOINING_CHILD = """
import json, os
import ray
import sbloader

ds = sbloader.range(30, num_partitions=3).map_batches(lambda b: {"id": b["id"] * 2})
rows = sorted(int(r["id"]) for r in ds.iter_rows())
info = sbloader.init()
sbloader.shutdown()
print(json.dumps({"rows": rows, "address": info.address, "embedded": info.embedded,
                  "ray_address": os.environ["RAY_ADDRESS"], "still_connected": ray.is_initialized()}),
      flush=True)
"""

SECOND_CLIENT = """
import json, os
import ray

ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False, log_to_driver=False)
answer = ray.get(ray.remote(lambda: 40 + 2).remote())
alive = sum(1 for n in ray.nodes() if n["Alive"])
print(json.dumps({"answer": answer, "alive_nodes": alive}), flush=True)
ray.shutdown()
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"the head holder printed nothing in {timeout} s")
    return proc.stdout.readline()


def test_joined_cluster_survives_pipeline_and_shutdown():
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HEAD_HOLDER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = _read_line(holder, 60)
        assert line.startswith("{"), f"the head did not start: {line!r} {holder.stderr.read()[-3000:] if holder.poll() is not None else ''}"
        head = json.loads(line)
        pids = {pid: psutil.Process(pid).create_time() for pid in (head["gcs_pid"], head["raylet_pid"])}

        out = _run_child(JOINING_CHILD, _env(RAY_ADDRESS=head["address"]))
        assert out["rows"] == [2 * i for i in range(30)]
        assert out["embedded"] is False and out["address"] == head["address"] == out["ray_address"]
        assert out["still_connected"] is False  # shutdown() disconnected the driver...

        # ... and left the cluster running: its processes, and a new client's task
        assert all(_alive(pid, t) for pid, t in pids.items()), "sbloader.shutdown() stopped a cluster it joined"
        second = _run_child(SECOND_CLIENT, _env(RAY_ADDRESS=head["address"]))
        assert second == {"answer": 42, "alive_nodes": 1}
        assert holder.poll() is None
    finally:
        if holder.poll() is None:
            holder.stdin.close()
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()


_ELSEWHERE = """
import json, sys
sys.path.insert(0, {folder!r})
import sbl_elsewhere
import sbloader

loader = sbloader.DataLoader(sbl_elsewhere.Squares(), batch_size=4, num_workers=2)
dropin = sorted(int(x) for b in loader for x in b)
del loader  # its warm actors give way to the pipeline's tasks (a live loader keeps them for its next epoch)
native = sorted(int(x) for b in sbloader.range(12, num_partitions=3).map_batches(sbl_elsewhere.plus_one)
                .to_dataloader(4) for x in b["id"])
# A folder put on the path after Ray started: the workers cannot know it, and the error says what to do.
sys.path.insert(0, {late!r})
import sbl_too_late
try:
    list(sbloader.DataLoader(sbl_too_late.Squares(), batch_size=4, num_workers=2))
    late = "no error"
except ModuleNotFoundError as e:
    late = f"{{e.name}}: {{e}}"
print(json.dumps({{"dropin": dropin, "native": native, "late": late}}))
"""


def test_a_dataset_and_a_function_from_a_folder_the_script_put_on_sys_path_run_in_rays_workers(tmp_path):
    """torch's workers see their parent's sys.path: a dataset class or a map function from a module found
    through a folder the script added (neither the script's folder nor the working directory) works in
    Ray's workers too, the drop-in's actors and a pipeline's tasks (no local start: Ray's workers only). A
    folder added after Ray started: torch's ``ModuleNotFoundError``, naming the module and what to do."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "sbl_elsewhere.py").write_text(textwrap.dedent("""
        import torch

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 12

            def __getitem__(self, i):
                return i * i

        def plus_one(batch):
            return {"id": batch["id"] + 1}
    """))
    late = tmp_path / "late"
    late.mkdir()
    (late / "sbl_too_late.py").write_text((folder / "sbl_elsewhere.py").read_text())
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(_ELSEWHERE.format(folder=str(folder), late=str(late)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env=_env(SBLOADER_LOCAL_START="0"), cwd=str(tmp_path))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    got = json.loads(lines[-1])
    late = got.pop("late")
    assert got == {"dropin": sorted(i * i for i in range(12)), "native": list(range(1, 13))}
    assert late.startswith("sbl_too_late: a pool actor of this loader cannot import module 'sbl_too_late'"), late
    assert "PYTHONPATH" in late and "py_modules" in late, late
