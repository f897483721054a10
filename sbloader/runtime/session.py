"""Where sbloader runs: the embedded local Ray, or a cluster named by an address.

With no ``RAY_ADDRESS`` (and no ``init(address=...)``) sbloader starts a fresh local
Ray of its own with ``address="local"`` (never a stale cluster found on the
machine), bound to loopback, dashboard off, token authentication left on, once per
process, stopped at exit. With an address it joins that cluster and never shuts
it down.

The embedded Ray is started on a thread of its own that lives as long as the
process (:func:`on_owner_thread`): Linux delivers a child's parent-death signal
when the *thread* that spawned it exits, so a Ray started from a short-lived
thread (a prefetching wrapper, an application's worker thread) would die with
that thread. Ray's daemons still die with the process, also on SIGKILL.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from sbloader.runtime import driver_path as _driver_path
from sbloader.runtime import exit_lock as _exit_lock  # noqa: F401 - here before ``import ray``: a child forked from
# a process with Ray's C++ threads sets the exit-handler lock free (:mod:`~sbloader.runtime.fork_child`)
from sbloader.runtime import join as _join
from sbloader.runtime import ray_chatter as _chatter
from sbloader.runtime import reaper as _reaper
from sbloader.runtime import rendezvous as _rendezvous
from sbloader.runtime import start_cut as _start_cut
from sbloader.runtime.loaded_modules import loaded as _loaded
from sbloader.runtime.fork_lock import spawns_apart_from_forks
from sbloader.runtime.open_files import check as _check_open_files
from sbloader.runtime.world import World

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"owned": False, "info": None}
_T = TypeVar("_T")
_OWNER: dict[str, Any] = {"thread": None, "calls": None}
_OWNER_LOCK = threading.Lock()


def _owner_loop(calls: "queue.SimpleQueue[tuple[Callable[[], Any], Future]]") -> None:
    while True:
        fn, done = calls.get()
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn())
        except BaseException as exc:  # handed to the caller, raised there
            done.set_exception(exc)


VERBOSE_ENV = "SBLOADER_RAY_VERBOSE"  # 1: show Ray's start-up messages (token banner, thread notices)

# Ray's loggers that speak while a Ray starts or is joined; at WARNING they print
# a token-auth banner and a note that SIGTERM is left to the owner thread. Both
# are about a Ray the user never asked for, so they are hidden unless asked.
_STARTUP_LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")


class _Quiet:
    """Raise Ray's start-up loggers to ERROR while Ray starts (unless ``SBLOADER_RAY_VERBOSE=1``)."""

    def __enter__(self) -> None:
        self._saved = []
        if os.environ.get(VERBOSE_ENV) == "1":
            return
        for name in _STARTUP_LOGGERS:
            log = logging.getLogger(name)
            self._saved.append((log, log.level))
            log.setLevel(logging.ERROR)

    def __exit__(self, *exc: Any) -> None:
        for log, level in self._saved:
            log.setLevel(level)


def _call(fn: Callable[[], _T]) -> _T:
    """``fn()``: a start that the exit does not cut short (a torchrun job's shared Ray)."""
    return fn()


def on_owner_thread(fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on the process's owner thread and return its result (or raise its error).

    The owner thread is a daemon thread started on first use that never ends
    while the process lives. Processes spawned from it (the embedded Ray's GCS,
    raylet and log monitor) carry a parent-death signal bound to it, so they live
    exactly as long as the process, whichever thread asked for them.
    """
    if threading.current_thread() is _OWNER["thread"]:
        return fn()
    with _OWNER_LOCK:
        if _OWNER["thread"] is None or not _OWNER["thread"].is_alive():
            calls: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_owner_loop, args=(calls,), name="sbloader-ray-owner", daemon=True)
            thread.start()
            _OWNER.update(thread=thread, calls=calls)
        done: Future = Future()
        _OWNER["calls"].put((fn, done))
    return done.result()

#: Ray's log monitor globs its log folder for new worker logs every 0.1 s until the folder
#: holds 1,000 files, then every 0.5 s. A loader's Ray starts a worker per pool actor, and
#: each leaves two files: at 0.1 s the globs cost the trainer's machine a CPU-second a
#: minute or more (Ray's largest daemon cost in issue #48's suite). With this in a Ray's
#: environment, every 0.5 s: a new worker's first prints reach the trainer up to 0.5 s later.
#: The tests' own Rays and ``ray start`` nodes take it too.
LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}

# Environment of the embedded Ray, set before it starts so every Ray process
# inherits it.
_EMBEDDED_ENV = {
    # Pin a local Ray to loopback; otherwise it advertises the external address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # The raylet frees released objects in batches, every second by default: a
    # streaming pipeline releases blocks far faster, and the object store would
    # hold a second's worth of blocks beyond the budget.
    "RAY_free_objects_period_milliseconds": "20",
    # Ray starts workers at niceness 15; a loader's workers are what the trainer
    # waits on, so they compete for CPU like torch's worker processes do.
    "RAY_worker_niceness": "0",
    **LOG_MONITOR_ENV,
}

# Ray's internal config for the embedded Ray only (``_system_config``: it stays
# with this Ray instead of leaking into the trainer's environment). It switches
# off what a loader's private Ray pays for but nobody reads: without a dashboard
# or state API there is no reader of metrics, task events or event-loop stats.
# Logs of workers (log monitor), task retries, the OOM monitor and token
# authentication stay as Ray has them. Before/after figures:
# benchmarks/results/embedded_ray.md (measured by the since-deleted bench_embedded_ray.py).
_EMBEDDED_SYSTEM_CONFIG: dict[str, Any] = {
    # No idle workers started with the driver (num_cpus of them, ~50-90 MiB PSS
    # each): the first tasks start the workers they need at the same moment.
    "prestart_worker_first_driver": False,
    # Ray kills a worker idle for 1 s above its soft limit (num_cpus). The task
    # workers of a source between its epochs (while coordinator actors hold
    # processes) were killed and started again, each importing torch again:
    # seconds per restart on 2 cores. Kept as long as our own warm pool (60 s).
    "idle_worker_killing_time_threshold_ms": 60_000,
    # Prometheus metrics recorded in every Ray process and exported every 10 s.
    "enable_metrics_collection": False,
    "emit_main_service_metrics": False,
    # Task state events and timeline profiling sent to the GCS once a second:
    # only the state API and dashboard read them.
    "task_events_report_interval_ms": 0,
    "enable_timeline": False,
    # Per-handler event-loop statistics and their dump to debug_state.txt every 10 s.
    "event_stats": False,
    "debug_dump_period_milliseconds": 0,
}


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``sbloader.init`` connected to.

    Attributes:
        address: the GCS address of the Ray cluster.
        embedded: True when sbloader started this Ray itself (and will stop it).
        node_id: the node id of the calling process.
    """

    address: str
    embedded: bool
    node_id: str


def init(
    address: Optional[str] = None,
    *,
    num_cpus: Optional[int] = None,
    num_gpus: Optional[int] = None,
    object_store_memory: Optional[int] = None,
    **ray_init_kwargs: Any,
) -> RuntimeInfo:
    """Start or join the Ray that sbloader runs on. Idempotent.

    Args:
        address: a Ray cluster address. ``None`` uses ``RAY_ADDRESS`` when set and
            otherwise starts an embedded local Ray bound to loopback.
        num_cpus: logical CPUs of the embedded Ray (default: the machine's).
        num_gpus: GPUs of the embedded Ray (default: detected).
        object_store_memory: object store size in bytes of the embedded Ray (default:
            :func:`~sbloader.runtime.store_size.embedded_store_bytes`, Ray's rule on the
            process's whole memory, so that it is known before Ray starts).
        **ray_init_kwargs: passed to ``ray.init`` unchanged.

    Returns:
        A :class:`RuntimeInfo` describing the Ray in use.
    """
    ray_now = _loaded("ray")
    if ray_now is None or not ray_now.is_initialized():
        _check_open_files()  # before ``import ray``: its C++ seeds its random numbers from a file as it loads,
        # and a process whose files run out meanwhile (torch's workers' tensors kept) aborts there
    import ray

    with _LOCK:
        if ray.is_initialized():
            if _STATE["info"] is None:
                ctx = ray.get_runtime_context()
                _STATE["info"] = RuntimeInfo(
                    address=ray.get_runtime_context().gcs_address,
                    embedded=False,
                    node_id=ctx.get_node_id(),
                )
            return _STATE["info"]
        address = address or os.environ.get("RAY_ADDRESS") or None
        world = World.detect() if address is None else None
        # a torchrun job's ranks share one embedded Ray (the others wait for local rank 0's): never cut short
        alone = world is None or world.world_size == 1
        if _start_cut.asked() and alone:  # a pool's prestart that waited for the start the exit cut short
            raise RuntimeError("sbloader: Ray is not started: the process exits (Python finalizes); "
                               "start it (sbloader.init()) before the end of the script to use it")
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        kwargs.update(ray_init_kwargs)
        job_config = _driver_path.job_config_for(kwargs)  # the workers find what this process finds
        if job_config is not None:
            kwargs["job_config"] = job_config
        if address is None:
            for key, value in _EMBEDDED_ENV.items():
                os.environ.setdefault(key, value)
            if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
                # ray read the variable at import; if ray was imported before
                # sbloader, apply it now so the node binds to loopback.
                from ray._private import ray_constants

                ray_constants.ENABLE_RAY_CLUSTER = False
            kwargs["_system_config"] = {**_EMBEDDED_SYSTEM_CONFIG, **(kwargs.get("_system_config") or {})}
            if object_store_memory is None:
                from sbloader.runtime.store_size import embedded_store_bytes

                object_store_memory = embedded_store_bytes()

            def start() -> str:
                with _Quiet(), spawns_apart_from_forks():  # a local worker forked meanwhile: fork_lock.py
                    on_owner_thread(lambda: (_start_cut.cancellable if alone else _call)(lambda: start_node_twice(
                        lambda: ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                                         object_store_memory=object_store_memory, **kwargs))))
                    _STATE["reaper"] = _start_reaper()
                return ray.get_runtime_context().gcs_address

            if world.world_size > 1:
                # torchrun: one embedded Ray per job, started by local rank 0.
                join_kwargs = {k: v for k, v in kwargs.items() if k != "_system_config"}
                from sbloader.runtime.job import store_for_rendezvous

                embedded = _rendezvous.join_shared(
                    world, start, lambda addr: ray.init(address=addr, **join_kwargs),
                    store=store_for_rendezvous(world),
                )
                _STATE["world"] = world
            else:
                start()
                embedded = True
            atexit.register(stop_at_exit)
        else:
            with _Quiet():
                ray.init(address=_join.prepare(address), **kwargs)
            embedded = False
        _chatter.install()  # Ray's retry and node-death lines: sbloader reports a loss in one line
        ctx = ray.get_runtime_context()
        info = RuntimeInfo(address=ctx.gcs_address, embedded=embedded, node_id=ctx.get_node_id())
        _STATE.update(owned=embedded, info=info)
        logger.info("sbloader: %s Ray at %s", "started embedded" if embedded else "joined", info.address)
        return info


#: What ``ray.init`` raises when its raylet never registered: on a loaded machine Ray 2.60's raylet aborts
#: when its dashboard agent has not written its ports within 15 s ("Timed out waiting for file
#: .../metrics_agent_port_...", raylet.out), a fixed wait; the agent's imports are then in the page cache.
NODE_START_TIMED_OUT = "timed out during startup"


def start_node_twice(start: Callable[[], _T]) -> _T:
    """``start()`` (the embedded ``ray.init``), and once more after ``ray.shutdown()`` when its node timed
    out during startup (:data:`NODE_START_TIMED_OUT`); any other error, or a second time out, is raised."""
    try:
        return start()
    except Exception as e:
        if NODE_START_TIMED_OUT not in str(e):
            raise
        import ray

        logger.info("sbloader: Ray's node timed out during startup (%s); starting it once more", e)
        ray.shutdown()
        return start()


def _start_reaper() -> Any:
    """A reaper for the embedded Ray's processes (:mod:`sbloader.runtime.reaper`), or None."""
    try:
        from ray._private import worker as ray_worker

        node = ray_worker._global_node
        pids = [proc.pid for _, proc in node.live_processes()] if node is not None else []
        return _reaper.start(pids)
    except Exception as exc:  # Ray internals moved: the parent-death signals still stop most of it
        logger.debug("sbloader: no reaper for the embedded Ray (%s)", exc)
        return None


_BEFORE_SHUTDOWN: list[Callable[[], Any]] = []


def before_shutdown(fn: Callable[[], Any]) -> None:
    """Have :func:`shutdown` call ``fn`` first (the loaders end their live epochs: no thread of
    theirs calls into a Ray that is gone)."""
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def stop_at_exit() -> None:
    """The process exits: nothing may start a Ray again (Ray's auto-init from a thread still
    running would print its start-up notices and fail), then :func:`shutdown`, quietly. A background
    start still under way was waited for before (:func:`sbloader.runtime.background.settle`, run
    ahead of every ``atexit`` hook)."""
    if _loaded("ray") is not None:  # never imported here: ``import ray`` where the files ran out aborts the process
        try:
            from ray._private import auto_init_hook

            auto_init_hook.enable_auto_connect = False
        except Exception:  # Ray internals moved: shutdown still runs
            pass
    with _Quiet():
        shutdown()


def shutdown() -> None:
    """Stop the embedded Ray if sbloader started it; only forget a joined cluster."""
    for fn in list(_BEFORE_SHUTDOWN):
        try:
            fn()
        except Exception as exc:  # a loader that cannot end its epoch must not keep Ray up
            logger.debug("sbloader: before shutdown: %s", exc)
    with _LOCK:
        world = _STATE.pop("world", None)
        if not _STATE["owned"] and _STATE["info"] is None:  # sbloader neither started nor joined a Ray
            return  # (``ray`` is not imported here: where the files ran out, its import aborts the process)
        import ray

        if _STATE["owned"] and ray.is_initialized():
            if world is not None:
                _rendezvous.wait_all_left(world)  # the other ranks still use this Ray
            ray.shutdown()
            reaper = _STATE.pop("reaper", None)
            if reaper is not None:
                reaper.stdin.close()  # Ray is stopped: the reaper sweeps what is left and exits
        elif ray.is_initialized() and _STATE["info"] is not None:
            ray.shutdown()
            if world is not None:
                _rendezvous.mark_left(world)
        _STATE.update(owned=False, info=None)


def ensure_initialized() -> RuntimeInfo:
    """Return the runtime, starting the default one on first use."""
    return init()


def cluster_cpus() -> float:
    """Logical CPUs of the whole cluster (at least 1)."""
    from sbloader.runtime import cluster_state

    return max(1.0, cluster_state.cpus())
