"""Many simulated ranks against one real split coordinator (issue #22).

Each simulated rank is a thread that speaks the ranks' protocol to the real
:class:`~sbloader.distributed.coordinator.SplitCoordinator` actor: it asks for its
next batches with ``next_batches`` (acknowledging what it consumed, one request
ahead, as :class:`~sbloader.distributed.dropin_client.Pull` does), "consumes" one
batch every ``1 / rate`` seconds (fetching its tiny block: the coordinator owns
the blocks, so it answers the owner's part of every fetch), leasing batches
by its pace, and after a coordinator death reports what it took
(:func:`~sbloader.distributed.dropin_client.rebuild_epoch`). The ranks run as
threads inside a few Ray actors (:class:`RankHost`, light processes), the epoch's
executor is the task-free stand-in of :mod:`~sbloader.distributed.sim_epoch`.

:func:`simulate` runs one epoch and returns what was measured: the coordinator
process's CPU per batch, every request's latency (submission to the reply's
arrival), the ledger's bytes, the consumed state's bytes, the rebuild's duration,
and each rank's taken batches (to check equal counts and exactly-once).
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Optional

import ray

from sbloader.core.lease import RateMeter, lease_size
from sbloader.distributed.coordinator import SplitCoordinator
from sbloader.distributed.dropin_client import rebuild_epoch
from sbloader.distributed.sim_epoch import rank_node, sim_spec

NAMESPACE = "sbloader-sim"


@dataclass(frozen=True)
class SimConfig:
    """One simulated epoch.

    Attributes:
        world_size: simulated ranks.
        per_rank: batches every rank takes.
        rate: batches per second each rank consumes (0: as fast as they come).
        ask: batches a rank asks for per request (its prefetch; the least it leases).
        lease: lease by the rank's pace as the drop-in's ranks do
            (:func:`~sbloader.core.lease.lease_size`); False asks ``ask`` every time.
        fetch: ``ray.get`` every batch's (tiny) block, as a rank does; the coordinator
            owns the blocks, so it answers the owner's part of every fetch.
        batch_size: rows per batch (positions in the ledger).
        in_order: per-rank queues (the drop-in's default) or the shared pool.
        nodes: simulated nodes the ranks and blocks sit on.
        name: the coordinator's actor name (generation ``:g`` appended).
        epoch: the epoch number.
        rebuild_timeout_s: how long a rank's rebuild may wait for the others.
    """

    world_size: int
    per_rank: int
    rate: float = 5.0
    ask: int = 2
    lease: bool = True
    fetch: bool = False
    batch_size: int = 64
    in_order: bool = True
    nodes: int = 1
    name: str = "sim-coordinator"
    epoch: int = 0
    rebuild_timeout_s: float = 30.0

    def spec(self) -> Any:
        """The epoch's spec (every rank computes the same)."""
        return sim_spec(self.epoch, self.world_size, self.per_rank, self.batch_size, in_order=self.in_order,
                        nodes=self.nodes)


def coordinator_name(cfg: SimConfig, generation: int) -> str:
    """The actor name of the ``generation``-th coordinator of a simulation (0: the first)."""
    return f"{cfg.name}:{generation}"


def new_coordinator(cfg: SimConfig, generation: int) -> Any:
    """Create the simulation's coordinator (the real actor class, a simulation's own name)."""
    return SplitCoordinator.options(name=coordinator_name(cfg, generation), namespace=NAMESPACE,
                                    lifetime="detached").remote(cfg.world_size, {"sim": cfg.name}, 600.0)


def _reconnect(cfg: SimConfig, generation: int, deadline: float) -> Any:
    while True:
        try:
            return ray.get_actor(coordinator_name(cfg, generation), namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def run_rank(cfg: SimConfig, rank: int, start_at: float, spec: Any) -> dict:
    """One simulated rank's epoch (a thread): its taken batch indices, request latencies and
    the wall time its first reply arrived after a rebuild."""
    node = rank_node(rank, cfg.world_size, cfg.nodes)
    coord, generation = ray.get_actor(coordinator_name(cfg, 0), namespace=NAMESPACE), 0
    lat: list[float] = []
    taken: list[int] = []
    ready: deque = deque()
    out: dict[str, Any] = {"rank": rank, "requests": 0, "rebuilt_at": None, "error": None}
    received = 0
    meter = RateMeter()

    def request() -> Any:
        out["requests"] += 1
        t0 = time.perf_counter()
        n = lease_size(meter.rate, cfg.ask) if cfg.lease else cfg.ask
        ref = coord.next_batches.remote(cfg.epoch, rank, n, len(taken), node)

        def arrived(fut: Any) -> None:
            if fut.exception() is None:
                lat.append(time.perf_counter() - t0)
        ref.future().add_done_callback(arrived)
        return ref

    period = 1.0 / cfg.rate if cfg.rate > 0 else 0.0
    due = start_at + (rank / cfg.world_size) * period  # ranks spread over one period
    time.sleep(max(0.0, start_at - time.time()))
    pending = request()
    rebuilding = False
    lost = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError)

    def rebuild(how: str) -> Any:
        nonlocal coord, generation, received, rebuilding, early
        out["noticed_at"], out["noticed_by"] = time.time(), how
        generation += 1
        coord = _reconnect(cfg, generation, time.monotonic() + cfg.rebuild_timeout_s)
        out["reconnected_at"] = time.time()
        rebuild_epoch(coord, cfg.epoch, rank, taken, spec if rank == 0 else None, cfg.rebuild_timeout_s)
        out["reported_at"] = time.time()
        ready.clear()
        early = None
        received, rebuilding = len(taken), True
        return request()

    try:
        early = None  # a reply that arrived while batches were still ready
        while len(taken) < cfg.per_rank:
            if early is None and pending is not None and ready and ray.wait([pending], timeout=0)[0]:
                try:  # the request ahead tells of a dead coordinator long before a block fetch does
                    early = ray.get(pending)
                except lost:
                    pending = rebuild("request ahead")
                    continue
            if not ready:
                try:
                    reply, early = (early if early is not None else ray.get(pending)), None
                except lost:  # the coordinator died: rebuild it from what the ranks took
                    pending = rebuild("reply")
                    continue
                if rebuilding:
                    out["rebuilt_at"], rebuilding = time.time(), False
                ready.extend(zip(reply["refs"], reply["index"]))
                received += len(reply["index"])
                pending = request() if received < cfg.per_rank else None
                continue
            if period:
                time.sleep(max(0.0, due - time.time()))
                due += period
            ref, index = ready[0]
            if cfg.fetch:
                tf = time.time()
                try:
                    ray.get(ref)  # a dead coordinator's blocks are lost
                except lost as e:
                    out["fetch_error"] = f"{type(e).__name__} after {time.time() - tf:.2f} s"
                    pending = rebuild("fetch")
                    continue
            ready.popleft()
            taken.append(index)
            meter.took(time.monotonic())
    except Exception as e:  # reported, not raised: the other ranks' figures still count
        out["error"] = f"{type(e).__name__}: {e}"
    out["taken"], out["latency_s"] = taken, lat
    return out


@ray.remote(num_cpus=0, max_concurrency=4)
class RankHost:
    """A light process running simulated ranks as threads."""

    def run(self, cfg: SimConfig, ranks: list, start_at: float) -> list:
        spec = cfg.spec()
        results: list = [None] * len(ranks)

        def one(i: int, r: int) -> None:
            results[i] = run_rank(cfg, r, start_at, spec)

        threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def _cpu_s(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list, q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def simulate(cfg: SimConfig, hosts: int = 1, kill_after_s: Optional[float] = None,
             lead_s: float = 2.0) -> dict:
    """Run one simulated epoch on the connected Ray and measure the coordinator.

    Args:
        cfg: the epoch.
        hosts: rank host processes (the ranks are spread over them).
        kill_after_s: kill the coordinator this long after the ranks start, and
            start a new one that the ranks rebuild from their logs.
        lead_s: seconds between creating the hosts and the ranks' common start.

    Returns:
        A JSON-serialisable dict (figures of it: ``benchmarks/results/coordinator_scale.md``).
    """
    coord = new_coordinator(cfg, 0)
    spec = cfg.spec()
    pid = ray.get(coord.process_info.remote())["pid"]
    ray.get(coord.start_epoch.remote(spec))  # what rank 0 does
    while not (ray.get(coord.execution_stats.remote(cfg.epoch)) or {}).get("ready"):
        time.sleep(0.02)
    host_actors = [RankHost.remote() for _ in range(max(1, hosts))]
    ray.get([h.__ray_ready__.remote() for h in host_actors])
    ranks = list(range(cfg.world_size))
    start_at = time.time() + lead_s
    futures = [h.run.remote(cfg, ranks[i::len(host_actors)], start_at) for i, h in enumerate(host_actors)]
    idle_cpu0, idle_t0 = _cpu_s(pid), time.monotonic()
    time.sleep(max(0.0, start_at - time.time()))
    idle_rate = (_cpu_s(pid) - idle_cpu0) / max(1e-3, time.monotonic() - idle_t0)  # the actor's floor
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    killed_at, cpu_old = None, 0.0
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        cpu_old = _cpu_s(pid) - cpu0
        ray.kill(coord)
        killed_at = time.time()
        coord = new_coordinator(cfg, 1)  # what the job's restart does; the ranks find it by name
        pid = ray.get(coord.process_info.remote())["pid"]
        cpu0 = _cpu_s(pid)
    results = [r for part in ray.get(futures) for r in part]
    wall = time.monotonic() - t0
    cpu = cpu_old + _cpu_s(pid) - cpu0
    ledger, consumed, cut_s = None, None, None
    try:  # a failed rebuild leaves no epoch to measure
        ledger = ray.get(coord.process_info.remote(), timeout=30)["ledger_bytes"].get(cfg.epoch)
        t_cut = time.perf_counter()
        consumed = ray.get(coord.cut.remote(cfg.epoch, cfg.per_rank, 5.0), timeout=30)
        cut_s = time.perf_counter() - t_cut
        ray.get([coord.finish.remote(cfg.epoch, r, cfg.per_rank) for r in ranks], timeout=30)
    except Exception as e:
        results.append({"error": f"measuring the ledger: {type(e).__name__}: {e}", "taken": [], "latency_s": [],
                        "requests": 0, "rebuilt_at": None, "rank": -1})
    for h in host_actors:
        ray.kill(h)
    ray.kill(coord)
    lat = [x for r in results for x in r["latency_s"]]
    batches = sum(len(r["taken"]) for r in results)
    rebuilt = [r["rebuilt_at"] for r in results if r["rebuilt_at"] is not None]
    out = {
        "config": asdict(cfg), "hosts": hosts, "wall_s": wall, "batches": batches,
        "coordinator_cpu_s": cpu, "cpu_ms_per_batch": 1e3 * cpu / max(1, batches),
        "idle_cpu_frac": idle_rate, "cpu_ms_per_batch_above_idle": 1e3 * max(0.0, cpu - idle_rate * wall) / max(1, batches),
        "requests": sum(r["requests"] for r in results),
        "latency_ms": {"p50": _ms(_pct(lat, 0.5)), "p99": _ms(_pct(lat, 0.99)), "max": _ms(max(lat, default=None)),
                       "n": len(lat)},
        "ledger_bytes": ledger,
        "state_bytes": len(json.dumps({"consumed": consumed})) if consumed is not None else None,
        "cut_ms": 1e3 * cut_s if cut_s is not None else None, "samples": batches * cfg.batch_size,
        "errors": [r["error"] for r in results if r["error"]][:5],
        "rebuild_s": (max(rebuilt) - killed_at) if killed_at is not None and len(rebuilt) == len(results) else None,
        "killed": killed_at is not None,
        "rebuild_phases_s": {k: (max(r[k] for r in results if r.get(k)) - killed_at)
                             for k in ("noticed_at", "reconnected_at", "reported_at")
                             if killed_at is not None and any(r.get(k) for r in results)},
        "noticed_by": {how: sorted(round(r["noticed_at"] - killed_at, 2) for r in results
                                   if r.get("noticed_by") == how)[-3:]
                       for how in {r.get("noticed_by") for r in results} if how and killed_at is not None},
    }
    out["fetch_errors"] = sorted({r.get("fetch_error", "")[:40] for r in results})[:5]
    out["check"] = check([r for r in results if r["rank"] >= 0], cfg)
    return out


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else 1e3 * x


def check(results: list, cfg: SimConfig) -> dict:
    """Equal counts and exactly-once over the ranks' taken batches."""
    counts = sorted({len(r["taken"]) for r in results})
    every = [b for r in results for b in r["taken"]]
    total = cfg.world_size * cfg.per_rank
    return {"counts": counts, "equal_counts": counts == [cfg.per_rank],
            "duplicates": len(every) - len(set(every)), "missing": total - len(set(every)),
            "exactly_once": len(every) == total and len(set(every)) == total}
