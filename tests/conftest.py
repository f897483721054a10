"""Shared fixtures: one embedded local Ray for the whole test session.

The tests: ``unit/`` needs no Ray (pure functions, types, the layering of the package);
``ray/`` runs on the session's Ray; ``e2e/`` starts processes of its own (torchrun
jobs, ``ray.cluster_utils.Cluster`` clusters, the trainers). ``harness.py`` is the
one resume harness every stateful piece is checked with.

Tests that need their own cluster (``ray.cluster_utils.Cluster``) or torchrun run
in subprocesses, so they never fight over this one.
"""
from __future__ import annotations

import gc
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, before ray imports

import pytest

import sbloader
from sbloader.runtime.session import LOG_MONITOR_ENV

# Every Ray the tests start (theirs, their scripts', ``ray.cluster_utils`` clusters) has its log monitor glob for
# new worker logs every 0.5 s, as the embedded Ray's does, not 0.1 s (issue #48).
for _key, _value in LOG_MONITOR_ENV.items():
    os.environ.setdefault(_key, _value)
from ray_logs import drop_this_rays_dead_workers_logs
from s3_server import S3Server, free_port, s3_environment

# The S3-compatible server's endpoint (the fault proxy in front of moto) is fixed now,
# before any Ray starts, so the session's Ray workers inherit it with the other AWS
# variables: every S3 client in the tests (pyarrow, boto3) talks to 127.0.0.1 only.
_S3_PROXY_PORT = free_port()
os.environ.update(s3_environment(f"http://127.0.0.1:{_S3_PROXY_PORT}"))
# Likewise every gs:// client (obstore's, pyarrow's) goes to the GCS emulator's port.
_GCS_PORT = free_port()
os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{_GCS_PORT}"

# More logical CPUs than the 2 cores, so a pipeline never waits on its own bookkeeping.
TEST_CPUS = 8


@pytest.fixture(scope="session")
def ray_session():
    """The session's embedded Ray (started once, stopped at the end)."""
    # Ray workers inherit this environment: let them import functions defined in
    # test modules (pickled by reference).
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    dirs = [tests_dir] + [os.path.join(tests_dir, d) for d in ("unit", "ray", "e2e")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in dirs + [os.environ.get("PYTHONPATH", "")] if p)
    # Tests simulate the ranks of one job as threads of this process (rank=/world_size=),
    # where no launcher identifies the job: the session is one job, named here.
    os.environ.setdefault("SBLOADER_JOB_ID", f"tests-{os.getpid()}")
    info = sbloader.init(num_cpus=TEST_CPUS, object_store_memory=512 * 2**20)
    # What lives now (torch, Ray, pyarrow, the collected test modules: ~200,000 objects) lives for
    # the session: out of the collector's sight, each full collection (the teardown below runs one
    # whenever a CPU is held past the idle actors) takes microseconds instead of 0.1-0.4 s. The
    # garbage made so far is collected first, so nothing a test may still free is frozen.
    gc.collect()
    gc.freeze()
    yield info
    sbloader.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free port of 127.0.0.1 with the fault proxy in front (on the
    port the AWS variables name), started on first use and stopped at the end."""
    server = S3Server.start(_S3_PROXY_PORT)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator (in memory) on the port ``STORAGE_EMULATOR_HOST`` names, with a bucket
    ``bkt``, started on first use and stopped at the end."""
    pytest.importorskip("gcp_storage_emulator")
    from gcs_server import GcsServer

    server = GcsServer.start(_GCS_PORT)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def exit_lock_hammer(tmp_path_factory):
    """``tests/scripts/exit_lock_hammer.c`` built (a loop that keeps the C library's exit-handler lock busy):
    its path; skipped without a C compiler, or off Linux and glibc (``sbloader/runtime/exit_lock.py``)."""
    import shutil
    import subprocess
    import sysconfig

    from sbloader.runtime import exit_lock

    if exit_lock._LIBC is None:
        pytest.skip("the exit-handler lock is glibc's on Linux (x86_64, aarch64)")
    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the exit-handler lock's hammer")
    out = str(tmp_path_factory.mktemp("hammer") / "hammer.so")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "exit_lock_hammer.c")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, source], check=True, capture_output=True)
    return out


@pytest.fixture
def no_idle_actors(ray_session):
    """The process's idle warm actors (earlier tests' loaders') killed before the test: it counts actors."""
    from sbloader.loaders import warm_workers

    warm_workers.release_idle()
    yield


def _cpus_held() -> float:
    """The session Ray's CPUs held now (by actors and running tasks)."""
    import ray

    return ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)


@pytest.fixture(autouse=True)
def _free_split_coordinators(request):
    """Kill the split coordinators a test left in the session's Ray, and free what its loaders still hold.

    A coordinator is a detached actor that keeps its worker pool for the rest of
    its job; in this one-Ray session every test's job ends with the test, and
    without this the pools of earlier tests would pile up until no CPU is free
    (the executor then warns and waits). A ``unit/`` test uses no Ray unless it asks for
    ``ray_session``: its teardown skips the cluster's listing (thousands of them, once the
    session's Ray is up, cost minutes of the suite).

    The process's idle warm actors stay, as in a user's process that builds one loader after
    another: the next test's loader of the same shape takes them (no new worker processes: a
    quarter of ``tests/ray``'s time went to starting them), and a pool of another shape makes
    them give way when it needs their CPUs (``warm_workers.give_way``). A test that counts
    actors starts from none with the ``no_idle_actors`` fixture.
    """
    yield
    import ray

    if not ray.is_initialized():
        return
    if "ray_session" not in request.fixturenames and request.path.parent.name == "unit":
        return
    from sbloader.loaders import closer, warm_workers
    from sbloader.runtime import background

    drop_this_rays_dead_workers_logs()  # Ray's log monitor looks at every file of its folder (ray_logs)
    background.join(60)  # pool prestarts the test began park their actors now, not after the next lines
    closer.drain(wait_s=0)  # the loaders the test dropped hand their actors to the idle pool now, not after the next line
    if _cpus_held() > warm_workers.idle_actors():
        # epochs the closer finished a moment ago hand their actors over now; and anything a test left in a
        # reference cycle that holds actor handles (an execution's scheduler and its outputs did, fixed in
        # sbloader/executor/outputs.py) would keep their CPUs until the collector's next full pass, rare in a
        # long session: later tests then wait for CPUs that do not come back (seen: a test_mix and a
        # test_stateful_hang_shapes test hung, one of them in CI's order: its 4 + 4 persistent workers need all 8
        # CPUs). One more pass and a collection whenever a CPU is held by more than the idle actors.
        gc.collect()
        closer.drain(wait_s=0)
    from sbloader.distributed.naming import NAMESPACE

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if not entry["namespace"].startswith(NAMESPACE) or not entry["name"].startswith("sbloader-coordinator:"):
            continue
        try:
            handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
        except ValueError:  # already gone
            continue
        try:
            ray.get(handle.shutdown.remote(), timeout=10)  # kills its cached pool actors
        except Exception:
            pass
        ray.kill(handle)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``), two groups run side by side: ``e2e/``
    (its own processes: torchrun jobs, ``ray start`` clusters, which leave the cores idle
    while they start and wait) in one worker, and ``ray/`` then ``unit/`` (the session's
    embedded Ray) in the other, each in the order it has alone."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = "e2e" if item.path.parent.name == "e2e" else "session"
        item.add_marker(pytest.mark.xdist_group(group))


_GROUP_SPANS: dict = {}  # this worker's xdist group -> [first test's start, last test's end] (time.time())
_GROUP_WALLS: dict = {}  # the controller's: group -> (seconds, worker)


def pytest_runtest_logstart(nodeid, location):
    if "@" in nodeid:  # an xdist worker's node id ends with "@<group>"
        _GROUP_SPANS.setdefault(nodeid.rsplit("@", 1)[1], [time.time(), 0.0])


def pytest_runtest_logfinish(nodeid, location):
    if "@" in nodeid:
        _GROUP_SPANS[nodeid.rsplit("@", 1)[1]][1] = time.time()


def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)  # set in an xdist worker only
    if out is not None:
        out["group_spans"] = {g: round(end - start, 1) for g, (start, end) in _GROUP_SPANS.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for group, seconds in (getattr(node, "workeroutput", None) or {}).get("group_spans", {}).items():
        _GROUP_WALLS[group] = (seconds, node.gateway.id)


_MACHINE: dict = {}  # the controller's: the loop's seconds and /proc/stat's busy seconds at the start


def _loop_seconds() -> float:
    """A 10**7-step Python loop's time: this VM's speed, which changes by 2x from hour to hour."""
    start = time.perf_counter()
    for _ in range(10**7):
        pass
    return time.perf_counter() - start


def _busy_cpu_seconds() -> float | None:
    """Every core's non-idle time since boot (``/proc/stat``), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def pytest_sessionstart(session):
    if getattr(session.config, "workerinput", None) is None:  # the controller (or the only process)
        _MACHINE.update(loop=_loop_seconds(), busy=_busy_cpu_seconds())


def pytest_terminal_summary(terminalreporter):
    """Each xdist group's wall time (first test's start to last test's end), to balance them by; the
    machine's speed at the start and the end and the CPU the run took (the suite is CPU-bound: its
    time follows the VM's speed, which the figures of two runs must be read with)."""
    if "loop" in _MACHINE:
        busy, end = _busy_cpu_seconds(), _loop_seconds()
        used = f", the machine's CPUs busy {busy - _MACHINE['busy']:,.0f} core-s" if busy and _MACHINE["busy"] else ""
        terminalreporter.write_line(f"machine: a 10**7-step Python loop {_MACHINE['loop']:.2f} s at the start, "
                                    f"{end:.2f} s at the end{used}")
    if _GROUP_WALLS:
        terminalreporter.write_line("xdist groups: " + ", ".join(
            f"{g} {s:,.0f} s ({w})" for g, (s, w) in sorted(_GROUP_WALLS.items(), key=lambda kv: -kv[1][0])))
