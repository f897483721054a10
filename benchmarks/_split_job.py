"""The torchrun job of ``bench_split.py`` (benchmark only): one job per world size.

    torchrun --standalone --nproc-per-node=N benchmarks/_split_job.py --paths-file F --out DIR \\
        --step-s S [--epochs K]

Every rank builds ``sbloader.DataLoader(ImageFolderDataset(paths), batch_size=64,
shuffle=True, num_workers=2, persistent_workers=True)`` (the image workload of
``_jpeg_workload.py``), so the split coordinator cuts each epoch across the ranks.
Schedule of epochs (each a new iterator; a gloo barrier before and after each):

- ``cold``: the first epoch (worker actors start), consumer idle;
- ``idle`` x K: the consumer only counts the batch;
- ``step`` x K: a simulated GPU step per batch on every rank: sleep ``--step-s``
  (1.5x the ceiling's time per batch);
- ``step_scaled`` x K (world size above 1 only): sleep ``--step-s`` x world size, so
  that all ranks together ask for what one rank asks in ``step``.

Instruments:

- every ``next_batches`` request to the coordinator is timed from submission to
  the arrival of its reply (the reply's ``ObjectRef.future()`` callback): a
  wrapper around the coordinator handle, set on the loader before the first
  epoch; sbloader's code is not changed;
- the consumer's wait for each batch (``next(it)``), and sbloader's own stall
  instrument (``loader.stall_stats()``);
- rank 0, after each epoch: 10 round trips of a trivial call on the coordinator
  (``process_info``), the actor call's own latency under the same load;
- rank 0, at each barrier: the coordinator's CPU ticks (``/proc/<pid>/stat``, the
  pid from ``SplitCoordinator.process_info()``), the CPU ticks of every process of
  the job by class, and the machine's busy ticks (``/proc/stat``).

Writes ``DIR/rank<r>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _jpeg_workload as w  # noqa: E402


# ----- the request timer --------------------------------------------------------------

class _TimedMethod:
    """``handle.next_batches`` with ``.remote`` timed to the arrival of the reply."""

    def __init__(self, method: Any, log: list, lock: threading.Lock) -> None:
        self._m, self._log, self._lock = method, log, lock

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        ref = self._m.remote(*args, **kwargs)
        rec = {"t0": t0, "submit_s": time.perf_counter() - t0, "t1": None, "n": None}
        with self._lock:
            self._log.append(rec)

        def done(fut: Any, rec: dict = rec) -> None:
            rec["t1"] = time.perf_counter()
            try:
                rec["n"] = len(fut.result()["refs"])
            except BaseException:
                rec["n"] = -1

        ref.future().add_done_callback(done)
        return ref


class TimedCoordinator:
    """The coordinator's actor handle with ``next_batches`` timed; everything else passes through."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.log: list[dict] = []
        self._lock = threading.Lock()

    @property
    def next_batches(self) -> _TimedMethod:
        return _TimedMethod(self._handle.next_batches, self.log, self._lock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def take(self) -> list[dict]:
        """The requests logged so far (and forget them)."""
        with self._lock:
            out, self.log[:] = list(self.log), []
        return out


# ----- CPU snapshots (rank 0) ------------------------------------------------------------

def _classify(pid: int, ranks: set, launcher: int, coordinator: int) -> str:
    if pid == coordinator:
        return "coordinator"
    if pid in ranks:
        return "ranks"
    if pid == launcher:
        return "launcher"
    c = h.classify(pid, trainer_pid=-1)
    return "workers" if c == "workers" and h.cmdline(pid).startswith("ray::") else c


def cpu_snapshot(launcher: int, coordinator: int) -> dict:
    """CPU ticks per pid of the job (the torchrun agent's tree) and the machine's busy ticks."""
    ppids = h._ppid_map()
    pids = h.descendants([launcher], ppids)
    ranks = {p for p, pp in ppids.items() if pp == launcher}
    ticks, cls = {}, {}
    for pid in pids:
        st = h._read_stat(pid)
        if st is not None:
            ticks[pid] = st[1]
            cls[pid] = _classify(pid, ranks, launcher, coordinator)
    busy, total = h.machine_busy_ticks()
    return {"t": time.perf_counter(), "ticks": ticks, "cls": cls, "busy": busy, "total": total}


def cpu_delta(a: dict, b: dict) -> dict:
    """CPU seconds by class between two snapshots, and the machine's load outside the job."""
    by_class: dict[str, float] = {}
    for pid, t in b["ticks"].items():
        c = b["cls"][pid]
        by_class[c] = by_class.get(c, 0.0) + (t - a["ticks"].get(pid, 0)) / h.CLK_TCK
    job = sum(by_class.values())
    total = (b["total"] - a["total"]) / h.CLK_TCK
    busy = (b["busy"] - a["busy"]) / h.CLK_TCK
    return {"cpu_s_by_class": {k: round(v, 4) for k, v in by_class.items()},
            "job_cpu_s": round(job, 4),
            "machine_cpu_frac": round(busy / total, 4) if total > 0 else None,
            "outside_cpu_frac": round(max(0.0, busy - job) / total, 4) if total > 0 else None}


# ----- the job ---------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--paths-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2, help="epochs per mode after the cold one")
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=w.BATCH)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # barriers between epochs only
    paths = Path(args.paths_file).read_text().split("\n")
    import ray

    import sbloader

    loader = sbloader.DataLoader(w.ImageFolderDataset(paths), batch_size=args.batch_size, shuffle=True,
                                 num_workers=args.workers, persistent_workers=True)
    t = time.perf_counter()
    if loader.split:
        handle = loader._coordinator()  # starts (local rank 0) or joins the job's Ray
        init_s = time.perf_counter() - t
        timed: Any = TimedCoordinator(handle)
        loader._carry.coordinator = timed
        info = ray.get(handle.process_info.remote())
    else:  # one rank: no coordinator, the loader runs its executor here
        sbloader.init()
        init_s = time.perf_counter() - t
        handle, timed, info = None, None, {"pid": -1, "rss": 0}
    launcher = os.getppid()

    schedule = [("cold", 0.0)] + [("idle", 0.0)] * args.epochs + [("step", args.step_s)] * args.epochs
    if world > 1:
        schedule += [("step_scaled", args.step_s * world)] * args.epochs
    log: dict[str, Any] = {"rank": rank, "world": world, "pid": os.getpid(), "len": len(loader),
                           "init_s": init_s, "coordinator": info, "step_s": args.step_s, "epochs": []}
    for epoch, (mode, sleep_s) in enumerate(schedule):
        dist.barrier()
        snap0 = cpu_snapshot(launcher, info["pid"]) if rank == 0 else None
        if timed is not None:
            timed.take()
        t_start, p_start = time.time(), time.perf_counter()
        wait = 0.0
        first = None
        images = batches = 0
        it = iter(loader)
        while True:
            tw = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                wait += time.perf_counter() - tw
                break
            now = time.perf_counter()
            wait += now - tw
            if first is None:
                first = now - p_start
            images += int(b[0].shape[0])
            batches += 1
            if sleep_s:
                time.sleep(sleep_s)
        p_end = time.perf_counter()
        t_end = time.time()
        reqs = timed.take() if timed is not None else []
        st = loader.stall_stats()
        dist.barrier()
        rec: dict[str, Any] = {
            "epoch": epoch, "mode": mode, "sleep_s": sleep_s, "t_start": t_start, "t_end": t_end,
            "wall_s": p_end - p_start, "first_s": first, "batches": batches, "images": images,
            "wait_s": wait, "stall_frac": wait / (p_end - p_start),
            "steady_stall_frac": (wait - (first or 0.0)) / (p_end - p_start - (first or 0.0)),
            "sbloader_stalls": None if st is None else {
                "wall_s": st.wall_s, "wait_ready_s": st.wait_ready_s, "fetch_s": st.fetch_s,
                "batches": st.batches, "stall_fraction": st.stall_fraction},
            "requests": [{"rtt_s": None if r["t1"] is None else r["t1"] - r["t0"], "submit_s": r["submit_s"],
                          "n": r["n"], "t0": r["t0"] - p_start} for r in reqs],
        }
        if rank == 0:
            rec["cpu"] = cpu_delta(snap0, cpu_snapshot(launcher, info["pid"]))
            if handle is not None:  # the round trip of a trivial call on the same actor, between epochs
                probe = []
                for _ in range(10):
                    tp = time.perf_counter()
                    ray.get(handle.process_info.remote())
                    probe.append(time.perf_counter() - tp)
                rec["trivial_call_s"] = probe
        log["epochs"].append(rec)
    log["coordinator_end"] = ray.get(handle.process_info.remote()) if handle is not None else None
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
