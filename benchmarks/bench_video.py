"""Video decode throughput: sbloader's ``read_videos`` against torch, Ray Data and the ceiling.

The workload: generated H.264 videos (``sbloader.datagen.write_video_folder``;
mpeg4 when PyAV has no libx264), cut into clips of ``--clip-len`` frames, ranges
of ``--frames-per-partition`` frames per task. Every contender runs the same
decode function, ``sbloader.sources.videos.decode_piece`` on the same frame ranges
(seek to the keyframe before the range, decode, drop the frames before it,
RGB conversion of every kept frame, one decoder thread), so the figures compare
the loaders, not decoders. The consumer only counts the frames (no training).

Contenders, run in turn per round (interleaved), one epoch each with a new
iterator (start-up included):

- ``ceiling, 1 process x N``: the decode of every range in this process, frames/s
  times the cores (N = nproc): the physical limit.
- ``ceiling, Pool(N)``: ``multiprocessing.Pool(N)`` decoding the ranges (the pool
  is started before the clock; only counts come back, no frames).
- ``sbloader``: ``read_videos(...).iter_batches(None)`` (one batch per range, as
  the torch and Ray Data contenders deliver) on the embedded Ray (``num_cpus`` =
  N); the dataset (and its probe of the files) is made once, outside the clock,
  as a user makes it once for many epochs; the probe time is reported apart.
- ``sbloader, batches of B clips``: the same, re-cut into batches of
  ``--batch-size`` clips in the consumer (a batch spanning two ranges is one copy).
- ``torch DataLoader (N workers)``: a map-style Dataset whose items are the same
  ranges (``batch_size=None``), with and without ``persistent_workers``.
- ``torch DataLoader, 1 clip per item``: the way video datasets are usually
  written (torchvision's ``VideoClips``): every item seeks to its own clip.
- ``Ray Data (own Ray)``: ``from_items(ranges).map_batches(decode).iter_batches(None)``
  in a child process with its own Ray (``num_cpus`` = N), so its workers never
  mix with sbloader's; only when ``ray.data`` imports
  (``pip install "ray[data]==2.60.0"``).

Run: ``python benchmarks/bench_video.py [--quick]``. Writes
``benchmarks/results/video.json`` and ``video.md`` (``--render video.json`` rebuilds
the Markdown from recorded runs).
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, before ray imports

# This checkout's sbloader, here, in spawned children and in Ray's workers (which
# inherit the environment), whatever another editable install points to.
_REPO = str(Path(__file__).resolve().parent.parent)
sys.path[:0] = [str(Path(__file__).resolve().parent), _REPO]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
import _harness as h  # noqa: E402

import numpy as np  # noqa: E402

import sbloader  # noqa: E402
from sbloader.datagen import write_video_folder  # noqa: E402
from sbloader.sources.videos import VideoPiece, decode_piece  # noqa: E402

NAME = "video"
TITLE = "Video decode throughput"
# Whether the runs now sample PSS (and Ray's store stats) every 0.25 s: only the memory
# rounds do; the throughput rounds sample CPU ticks only (reading PSS of a Ray process
# tree slows its pipeline, see bench_ray_bound.py).
MEMORY = {"sample": False}
_NONE = -(2**62)  # "no timestamp" in Ray Data's Arrow columns


def decode_clips(piece: VideoPiece, clip_len: int) -> dict[str, Any]:
    """One range as the loaders deliver it: a ``clip`` array and ``frame_index``."""
    frames = decode_piece(piece)
    n = len(frames) // clip_len
    clips = np.stack(frames[:n * clip_len]).reshape((n, clip_len) + frames[0].shape)
    return {"clip": clips, "frame_index": piece.start + clip_len * np.arange(n)}


def count_frames(piece: VideoPiece, clip_len: int) -> int:
    """The ceiling's unit of work: :func:`decode_clips`, returning only the frame count."""
    return int(decode_clips(piece, clip_len)["clip"].shape[0]) * clip_len


class RangeDataset:
    """A map-style torch Dataset: item ``i`` is the clips of range ``i``."""

    def __init__(self, pieces: list[VideoPiece], clip_len: int) -> None:
        self.pieces, self.clip_len = pieces, clip_len

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return decode_clips(self.pieces[i], self.clip_len)


def _piece_columns(pieces: list[VideoPiece]) -> list[dict[str, Any]]:
    """Ranges as rows Ray Data can hold (Arrow columns cannot mix None and ints: ``_NONE`` is None)."""
    return [{"path": q.path, "start": q.start, "stop": q.stop,
             "start_pts": _NONE if q.start_pts is None else q.start_pts,
             "stop_pts": _NONE if q.stop_pts is None else q.stop_pts,
             "seek_ts": _NONE if q.seek_ts is None else q.seek_ts} for q in pieces]


def _ray_data_decode(batch: dict[str, np.ndarray], clip_len: int) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` function: decode the ranges of a batch of rows."""
    def opt(v: Any) -> Optional[int]:
        return None if int(v) == _NONE else int(v)

    outs = [decode_clips(VideoPiece(str(p), int(a), int(b), opt(sp), opt(ep), opt(sk)), clip_len)
            for p, a, b, sp, ep, sk in zip(batch["path"], batch["start"], batch["stop"], batch["start_pts"],
                                           batch["stop_pts"], batch["seek_ts"])]
    return {"clip": np.concatenate([o["clip"] for o in outs]),
            "frame_index": np.concatenate([o["frame_index"] for o in outs])}


def ray_data_server(conn: Any, rows: list[dict[str, Any]], clip_len: int, cores: int) -> None:
    """Child process: its own Ray (so Ray Data's workers never mix with sbloader's), one epoch per request."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    import ray.data

    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    # This module is ``__mp_main__`` here, which Ray's workers cannot import: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    try:
        while (msg := conn.recv()) != "stop":
            sample = msg == "run-sampled"
            rds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
                _ray_data_decode, fn_kwargs={"clip_len": clip_len}, batch_size=1)
            with h.measure("Ray Data", object_store=sample, pss=sample) as m:
                for batch in m.watch(lambda: rds.iter_batches(batch_size=None)):
                    m.add_items(int(batch["clip"].shape[0]) * clip_len)
            conn.send(m.result.as_dict())
    finally:
        ray.shutdown()


def ray_data_version() -> Optional[str]:
    """Ray Data's version when ``ray.data`` imports, else None."""
    try:
        import ray.data  # noqa: F401
    except Exception:
        return None
    return h._version("ray")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, smaller videos and 3 rounds")
    p.add_argument("--videos", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=360)
    p.add_argument("--gop", type=int, default=30, help="frames between keyframes")
    p.add_argument("--clip-len", type=int, default=8)
    p.add_argument("--frames-per-partition", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="clips per batch")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--retries", type=int, default=1,
                   help="re-runs of a round in which other processes took > 5%% of the CPU")
    p.add_argument("--quiet-wait-s", type=float, default=15.0,
                   help="before each round, wait up to this long for the machine to be quiet")
    p.add_argument("--no-ray-data", action="store_true")
    p.add_argument("--memory-rounds", type=int, default=1,
                   help="rounds sampled for peak PSS and object-store bytes after the throughput rounds")
    p.add_argument("--no-write", action="store_true", help="print, do not write results")
    p.add_argument("--render", metavar="JSON", help="only rebuild the Markdown from a results JSON")
    args = p.parse_args()
    if args.render:
        rerender(args.render)
        return
    n_videos = args.videos or (6 if args.quick else 16)
    n_frames = args.frames or (120 if args.quick else 300)
    rounds = args.rounds or (3 if args.quick else 5)
    cores = len(os.sched_getaffinity(0))

    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    data = os.path.join(tempfile.gettempdir(), f"sbloader-bench-videos-{n_videos}x{n_frames}-"
                                               f"{args.width}x{args.height}-{codec}-g{args.gop}")
    print(f"writing {n_videos} videos of {n_frames} frames ({args.width}x{args.height}, {codec}) in {data}", flush=True)
    write_video_folder(data, n_videos, frames=n_frames, width=args.width, height=args.height, fps=30,
                       codec=codec, gop_size=args.gop)

    sbloader.init(num_cpus=cores)
    t0 = time.perf_counter()
    ds = sbloader.read_videos(data, clip_len=args.clip_len, frames_per_partition=args.frames_per_partition)
    probe_s = time.perf_counter() - t0
    pieces = [part.payload for part in ds.source.partitions(0, 0)]
    frames_total = ds.num_rows() * args.clip_len
    clip_ds = sbloader.read_videos(data, clip_len=args.clip_len, frames_per_partition=args.clip_len)
    clip_pieces = [part.payload for part in clip_ds.source.partitions(0, 0)]
    print(f"{len(pieces)} ranges, {frames_total} frames per epoch; probe {probe_s:.2f}s", flush=True)

    ctx = mp.get_context("fork")
    pool = ctx.Pool(cores)
    persistent: dict[str, Any] = {}

    def run_ceiling_serial() -> h.Result:
        with h.measure("ceiling, 1 process", tree=h.ProcTree(ray=False, exclude=others()),
                       pss=MEMORY["sample"]) as m:
            for piece in pieces:
                m.add_items(count_frames(piece, args.clip_len))
                m.mark_first()
        r = m.result
        r.extra["scaled_items_per_s"] = r.items_per_s * cores
        return r

    def run_ceiling_pool() -> h.Result:
        with h.measure("ceiling, Pool", tree=h.ProcTree(ray=False, exclude=others()), pss=MEMORY["sample"]) as m:
            for n in pool.imap_unordered(functools.partial(count_frames, clip_len=args.clip_len), pieces):
                m.add_items(n)
                m.mark_first()
        return m.result

    def run_sbloader(batch_size: Optional[int]) -> Callable[[], h.Result]:
        def run() -> h.Result:
            with h.measure("sbloader", tree=h.ProcTree(exclude=others()), object_store=MEMORY["sample"],
                           pss=MEMORY["sample"]) as m:
                for batch in m.watch(lambda: ds.iter_batches(batch_size)):
                    m.add_items(int(batch["clip"].shape[0]) * args.clip_len)
            return m.result
        return run

    def torch_loader(dataset: Any, **kw: Any) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(dataset, num_workers=cores, multiprocessing_context=ctx, **kw)

    def run_torch(persistent_workers: bool) -> Callable[[], h.Result]:
        def run() -> h.Result:
            label = "torch" + (" persistent" if persistent_workers else "")
            if persistent_workers:
                loader = persistent.setdefault("loader", torch_loader(
                    RangeDataset(pieces, args.clip_len), batch_size=None, persistent_workers=True))
            else:
                loader = torch_loader(RangeDataset(pieces, args.clip_len), batch_size=None)
            with h.measure(label, tree=h.ProcTree(ray=False, exclude=others()), pss=MEMORY["sample"]) as m:
                for batch in m.watch(lambda: iter(loader)):
                    m.add_items(int(batch["clip"].shape[0]) * args.clip_len)
            return m.result
        return run

    def run_torch_per_clip() -> h.Result:
        loader = torch_loader(RangeDataset(clip_pieces, args.clip_len), batch_size=args.batch_size)
        with h.measure("torch 1 clip/item", tree=h.ProcTree(ray=False, exclude=others()),
                       pss=MEMORY["sample"]) as m:
            for batch in m.watch(lambda: iter(loader)):
                m.add_items(int(batch["clip"].shape[0]) * int(batch["clip"].shape[1]) * args.clip_len)
        return m.result

    contenders: dict[str, Callable[[], h.Result]] = {
        "ceiling, 1 process x N": run_ceiling_serial,
        "ceiling, Pool(N)": run_ceiling_pool,
        "sbloader": run_sbloader(None),
        f"sbloader, batches of {args.batch_size} clips": run_sbloader(args.batch_size),
        "torch DataLoader (N workers)": run_torch(False),
        "torch DataLoader (N workers, persistent)": run_torch(True),
        "torch DataLoader, 1 clip per item": run_torch_per_clip,
    }
    rd_version = None if args.no_ray_data else ray_data_version()
    server = None
    if rd_version is not None:
        spawn = mp.get_context("spawn")
        conn, child_conn = spawn.Pipe()
        server = spawn.Process(target=ray_data_server, daemon=True,
                               args=(child_conn, _piece_columns(pieces), args.clip_len, cores))
        server.start()

        def run_ray_data() -> h.Result:
            conn.send("run-sampled" if MEMORY["sample"] else "run")
            return h.Result(**conn.recv())

        contenders["Ray Data (own Ray)"] = run_ray_data

    def others() -> frozenset:
        """The Ray Data process and its Ray: never counted in the other contenders' trees."""
        return frozenset(h.descendants([server.pid])) if server is not None else frozenset()

    def progress(name: str, rnd: int, r: h.Result, tag: str = "round") -> None:
        rate = r.extra.get("scaled_items_per_s", r.items_per_s) or 0
        print(f"  {tag} {rnd}: {name:<42} {rate:8.0f} frames/s  outside CPU {r.outside_cpu_frac:.0%}", flush=True)

    for fn in contenders.values():  # warm-up (page cache, imports), not recorded
        fn()
    results = h.interleave(contenders, rounds, accept=h.quiet, max_retries=args.retries,
                           before_round=lambda: h.wait_quiet(timeout_s=args.quiet_wait_s), on_result=progress)
    memory: dict[str, list[h.Result]] = {}
    if args.memory_rounds:
        MEMORY["sample"] = True
        memory = h.interleave(contenders, args.memory_rounds, before_round=lambda: h.wait_quiet(timeout_s=5),
                              on_result=lambda n, r, res: progress(n, r, res, "memory"))
        MEMORY["sample"] = False
    persistent.clear()  # stops the persistent torch workers
    pool.close()
    pool.join()
    if server is not None:
        conn.send("stop")
        server.join(timeout=60)

    setup = (f"{n_videos} videos x {n_frames} frames, {args.width}x{args.height}, {codec} (keyframe every "
             f"{args.gop} frames), clips of {args.clip_len} frames, ranges of {args.frames_per_partition} frames "
             f"({len(pieces)} ranges, delivered one batch per range unless a batch size is named): "
             f"{frames_total} frames per epoch; N = {cores} cores")
    info = {"setup": setup, "probe_s": probe_s, "frames_per_epoch": frames_total, "rounds": rounds,
            "cores": cores, "videos": n_videos, "frame_bytes": args.width * args.height * 3, "ray_data": rd_version,
            "memory_rounds": args.memory_rounds}
    machine = h.machine_info()
    machine["versions"]["av"] = h._version("av")
    machine["versions"]["ray[data]"] = rd_version
    payload, md = report(results, info, memory)
    payload.update(command=h.command_line(), machine=machine)
    print(md)
    if not args.no_write:
        jpath, mpath = h.write_results(NAME, payload, md, title=TITLE)
        print(f"wrote {jpath} and {mpath}")
    sbloader.shutdown()


def _rate(r: h.Result) -> Optional[float]:
    return r.extra.get("scaled_items_per_s", r.items_per_s)


CEILING, POOL, SBLOADER = "ceiling, 1 process x N", "ceiling, Pool(N)", "sbloader"


def report(results: dict[str, list[h.Result]], info: dict[str, Any],
           memory: Optional[dict[str, list[h.Result]]] = None) -> tuple[dict[str, Any], str]:
    """The summary (JSON payload without command/machine) and the Markdown of a set of runs.

    Args:
        results: contender -> one :class:`_harness.Result` per round.
        info: setup, probe_s, frames_per_epoch, rounds, cores, videos, frame_bytes, ray_data.
        memory: contender -> the memory rounds' results (peak PSS and store bytes come
            from these; without them, from ``results``).
    """
    cores, frames_total = info["cores"], info["frames_per_epoch"]
    rows, summary = [], {}
    for name, rs in results.items():
        for r in rs:
            if r.items != frames_total:
                raise RuntimeError(f"{name} delivered {r.items} frames, expected {frames_total}")
        frac = h.summarize([_rate(r) / _rate(c) for r, c in zip(rs, results[CEILING])])
        frac_pool = h.summarize([_rate(r) / _rate(c) for r, c in zip(rs, results[POOL])])
        cpu = {c: h.summarize([r.cpu_s_by_class.get(c, 0.0) * 1e6 / r.items for r in rs])
               for c in ("trainer", "workers", "raylet", "gcs", "ray_daemons")}
        cpu["ray_all_daemons"] = h.summarize([sum(r.cpu_s_by_class.get(c, 0.0) for c in ("raylet", "gcs", "ray_daemons"))
                                              * 1e6 / r.items for r in rs])
        # Contention-proof: with the cores to itself, a loader reaches (the ceiling's CPU per
        # frame) / (its whole tree's CPU per frame) of the ceiling.
        cpu_bound = h.summarize([c.cpu_s_tree / c.items / (r.cpu_s_tree / r.items) if r.cpu_s_tree > 0 else None
                                 for r, c in zip(rs, results[CEILING])])
        d = summary[name] = {
            "frames_per_s": h.summarize([_rate(r) for r in rs]), "fraction_of_ceiling": frac,
            "fraction_of_pool": frac_pool, "cpu_bound_fraction": cpu_bound,
            "first_batch_s": h.summarize([r.first_item_s for r in rs]),
            "peak_pss_bytes": h.summarize([r.peak_pss_bytes for r in (memory or {}).get(name) or rs]),
            "peak_object_store_bytes": h.summarize([r.peak_object_store_bytes
                                                    for r in (memory or {}).get(name) or rs]),
            "cpu_us_per_frame": cpu, "outside_cpu_frac": h.summarize([r.outside_cpu_frac for r in rs])}
        rows.append({
            "contender": name,
            "frames/s": h.fmt_range(d["frames_per_s"], "{:.0f}"),
            "× ceiling": h.fmt_range(frac, "{:.2f}"),
            "× Pool(N)": h.fmt_range(frac_pool, "{:.2f}"),
            "CPU-bound × ceiling": h.fmt_range(cpu_bound, "{:.2f}"),
            "1st batch s": h.fmt_range(d["first_batch_s"], "{:.2f}"),
            "peak PSS MiB": h.fmt_range(d["peak_pss_bytes"], "{:.0f}", 1 / 2**20),
            "store MiB": (h.fmt_range(d["peak_object_store_bytes"], "{:.0f}", 1 / 2**20)
                          if d["peak_object_store_bytes"]["n"] else "–"),
            "CPU µs/frame trainer": h.fmt_range(cpu["trainer"], "{:.0f}"),
            "workers": h.fmt_range(cpu["workers"], "{:.0f}"),
            "Ray daemons": h.fmt_range(cpu["ray_all_daemons"], "{:.0f}"),
            "outside CPU %": h.fmt_range(d["outside_cpu_frac"], "{:.0f}", 100),
        })
    pool_eff = summary[POOL]["fraction_of_ceiling"]
    md = [
        f"{info['rounds']} interleaved rounds (after one warm-up round), median (min–max); a round whose runs "
        "other processes disturbed (more than 5% of the machine's CPU outside the measured processes) is run "
        "again (up to `--retries` times) and the quieter attempt kept. Each run is one epoch with a new iterator, "
        "start-up included."
        + (f" The rounds sample CPU ticks only; peak PSS and object-store bytes come from {info['memory_rounds']} "
           "memory round(s) after them, sampled every 0.25 s (sampling PSS during a run slows the Ray contenders "
           "most, see `ray_bound.md`)." if info.get("memory_rounds") else ""),
        "",
        f"- Workload: {info['setup']}.",
        "- Every contender runs the same decode (`sbloader.sources.videos.decode_piece`: seek to the keyframe before the "
        "range, decode, drop the frames before it, RGB, stack into clips; one decoder thread). The consumer only "
        "counts frames.",
        f"- `× ceiling`: against the decode alone in one process, times {cores} (per round). `× Pool(N)`: against "
        f"`multiprocessing.Pool({cores})` running the same decode (only counts come back). On this machine two "
        f"decoders side by side reach {h.fmt_range(pool_eff, '{:.2f}')} of twice one decoder, so the Pool is the "
        "parallel limit a loader can reach here.",
        "- `CPU-bound × ceiling`: the ceiling's CPU per frame over the contender's whole process tree's (trainer, "
        "workers, Ray daemons), per round: what the contender would reach with the cores to itself; other "
        "processes on this shared machine move it little. A child of the measuring process that exits during a "
        "run (the non-persistent torch workers) counts in full, through the parent's waited-for children's CPU.",
        "- CPU per frame by process class; `Ray daemons` = raylet + gcs + other Ray processes. `outside CPU %`: "
        "the machine's CPU other processes took during the run.",
        f"- sbloader's probe of the {info['videos']} files (demux, no decode; once per dataset, in remote tasks): "
        f"{info['probe_s']:.2f} s.",
        "",
        h.markdown_table(rows),
        "",
    ]
    if info["ray_data"] is None:
        md.append("Ray Data: not measured: `ray.data` does not import here (install the benchmark-only extra "
                  "`pip install \"ray[data]==2.60.0\"`).")
        md.append("")
    sb, cl = summary[SBLOADER], summary[CEILING]
    med = lambda d: d["median"]  # noqa: E731
    findings = [
        "## Findings",
        "",
        f"- sbloader delivers {med(sb['frames_per_s']):.0f} frames/s: {med(sb['fraction_of_ceiling']):.2f}x the "
        f"ceiling (target 0.9x: {'met' if med(sb['fraction_of_ceiling']) >= 0.9 else 'not met'}), "
        f"{med(sb['fraction_of_pool']):.2f}x the Pool({cores}) parallel limit, "
        f"{med(sb['cpu_bound_fraction']) or float('nan'):.2f}x the ceiling by CPU per frame.",
    ]
    for other in [k for k in summary if k.startswith(("torch", "Ray Data"))]:
        ratio = med(sb["frames_per_s"]) / med(summary[other]["frames_per_s"])
        findings.append(f"- against {other}: {ratio:.2f}x its throughput.")
    extra = med(sb["cpu_us_per_frame"]["workers"]) - med(summary[POOL]["cpu_us_per_frame"]["workers"])
    findings.append(
        f"- Where sbloader's extra CPU goes, per frame, against the Pool's workers: read tasks "
        f"+{extra:.0f} µs (the block's pickle and copy into the consumer's shared-memory slot, "
        f"{info['frame_bytes'] / 2**10:.0f} KiB per frame, and Ray's task handling), the consumer {med(sb['cpu_us_per_frame']['trainer']):.0f} µs, "
        f"Ray's daemons {med(sb['cpu_us_per_frame']['ray_all_daemons']):.0f} µs; the ceiling's own decode is "
        f"{med(cl['cpu_us_per_frame']['trainer']):.0f} µs.")
    md += findings
    payload = {**info, "summary": summary, "runs": {k: [r.as_dict() for r in v] for k, v in results.items()},
               "memory_runs": {k: [r.as_dict() for r in v] for k, v in (memory or {}).items()}}
    return payload, "\n".join(md)


def rerender(path: str) -> None:
    """Rebuild ``video.md`` (and the summary in ``video.json``) from the runs a JSON file holds."""
    data = json.loads(Path(path).read_text())
    results = {k: [h.Result(**r) for r in v] for k, v in data["runs"].items()}
    memory = {k: [h.Result(**r) for r in v] for k, v in data.get("memory_runs", {}).items()}
    info = {k: data[k] for k in ("setup", "probe_s", "frames_per_epoch", "rounds", "cores", "videos", "frame_bytes",
                                 "ray_data")}
    info["memory_rounds"] = data.get("memory_rounds", 0)
    payload, md = report(results, info, memory)
    payload.update(command=data["command"], machine=data["machine"])
    h.write_results(NAME, payload, md, title=TITLE)
    print(md)


if __name__ == "__main__":
    main()
