"""SD pipeline throughput and stall fraction (issue #7, benchmark 1).

The workload is ``trainers/train_sd.py``'s package ``trainers/sd`` itself (imported, not copied): Parquet rows
of JPEG bytes + captions -> decode/resize/crop/flip/tokenize (``preprocess``) ->
a small VAE encoder + text encoder (``SDEncoders``) -> a small UNet trained with
the DDPM loss (``sd.loop.train``; 64 px images, batch 8, 8x8 latents, on CPU).
Every contender runs that same training loop; only the source of the encoded
batches changes (``train(..., source=...)``), wrapped to time each step.

**Scale-out emulated by CPU affinity on one 2-core host** (BENCHMARKING.md), the
way ``bench_scaleout.py`` does it and with its helpers (``_scaleout_job.py``,
``_scaleout_node.py``): the trainer and the head Ray run pinned to core 0 (the
"trainer node": its one core is the bottleneck); the extra "CPU node" is a Ray
worker node pinned to core 1, joined over loopback with the head's auth token.
Contenders, interleaved in each round:

- ``torch_w1`` / ``torch_w2``: train_sd's ``--loader torch`` baseline, everything on
  core 0 (no Ray): torch's ``DataLoader`` with 1 or 2 workers decoding, the
  encoders in the trainer process. The better of the two (per round) is the
  baseline the ratio is taken against.
- ``raydata``: Ray Data on the 2-node cluster: ``ray.data.read_parquet`` ->
  ``map_batches(preprocess)`` (tasks) -> ``map_batches(SDEncoders,
  compute=ActorPoolStrategy(size=1))`` -> ``iter_torch_batches(8)``; Ray places
  the work on either node.
- ``sbloader``: the pipeline exactly as ``train_sd.py --loader sbloader`` builds it,
  on the 2-node cluster, default placement (preprocessing and the encoder pool
  stay off the trainer's node when another node has CPUs).
- ``sbloader_allow``: the same pipeline through ``Dataset.execute(...,
  allow_trainer_node=True)`` (both nodes), batched the same way.
- ``sbloader_1node``: the pipeline with no extra node (everything on core 0), for
  reference.

Logical CPUs: the trainer node's head advertises 1 CPU (its one core). A node
that must hold the encoder actor (1 logical CPU) beside a decode task (1) must
advertise 2, or the pool would hold the node's only slot and starve the decode
stage; so the extra node (one physical core) advertises 2, and so does the head
of the no-extra-node job. Logical CPUs are scheduling slots; the physical limit
is the ``taskset`` pinning.

Each run is one epoch of the generated dataset (4,096 rows = 512 steps; 2,048 with
``--quick``), a fresh iterator as users run them. Figures per run, over the epoch
after its first ``--skip`` steps, up to the last step taken while the pipeline was
still encoding (after it a buffering pipeline's trainer only drains what was made
ahead; the whole epoch is reported too): training samples/s, stall fraction (time
the loop waited in ``next()`` for the next batch / wall; for the torch baseline that
wait includes encoding in the trainer), the median step compute, CPU per sample by
process class (trainer, by thread too; Ray workers and daemons of the head,
``node2_*`` of the extra node; DataLoader workers), where the pipeline's work ran
(its workers' CPU on core 0), peak PSS of the whole process tree (over the run),
and the load of other processes on each pinned core (a run where they took more
than ``--max-outside`` of a core gets one make-up run; the quieter is kept). Every
pipeline's encoders stamp their batches, so a window made of batches encoded before
the trainer started (a buffer draining) would show (``prefilled``). Calibrated in
each round on core 0: the UNet step alone (the bound when data is free), and the
CPU per sample of the decode stage and of the encoders, from which the ideal rates
follow.

Run: ``python benchmarks/bench_sd.py [--quick]`` (full runs under ``flock
/tmp/sbloader_bench.lock``). Writes ``benchmarks/results/sd.json``, ``sd.md``,
``sd.png``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRAINERS = REPO / "trainers"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TRAINERS))
import _gitstate  # noqa: E402
import _harness as h  # noqa: E402
import _jobs  # noqa: E402

NAME = "sd"
TORCH = ("torch_w1", "torch_w2")
CLUSTER = ("sbloader", "sbloader_allow", "raydata")
CONTENDERS = TORCH + CLUSTER + ("sbloader_1node",)
DISPLAY = {
    "torch_w1": "torch DataLoader, 1 worker, encoders in the trainer (core 0 only)",
    "torch_w2": "torch DataLoader, 2 workers, encoders in the trainer (core 0 only)",
    "raydata": "Ray Data read_parquet -> map_batches x2 -> iter_torch_batches (core 0 + node)",
    "sbloader": "sbloader pipeline, default placement (core 0 + node)",
    "sbloader_allow": "sbloader pipeline, allow_trainer_node=True (core 0 + node)",
    "sbloader_1node": "sbloader pipeline, no extra node (core 0 only)",
}


# =====================================================================================
# Inside a job (pinned to the trainer's core by taskset)
# =====================================================================================


def thread_ticks() -> dict[int, tuple[str, int]]:
    """This process's threads: tid -> (name, utime+stime ticks); Python threads by their Python name."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = names.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            raw = Path(f"/proc/self/task/{tid}/stat").read_bytes()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2:].split()
        out[int(tid)] = (comm, int(rest[11]) + int(rest[12]))
    return out


def _thread_group(name: str) -> str:
    """A thread's name without per-instance suffixes (Ray Data's executor names its dataset)."""
    import re

    if name.startswith("StreamingExecutor"):
        return "ray-data-StreamingExecutor"
    return re.sub(r"[-_ ]?\d+([-_]\d+)*$", "", name) or name


def thread_cpu_s(a: dict, b: dict) -> dict[str, float]:
    """CPU seconds per thread group of this process between two :func:`thread_ticks` snapshots."""
    pid = os.getpid()
    out: dict[str, float] = {}
    for tid, (name, ticks) in b.items():
        group = "main" if tid == pid else _thread_group(name)
        out[group] = out.get(group, 0.0) + (ticks - a.get(tid, (name, 0))[1]) / h.CLK_TCK
    return {k: round(v, 3) for k, v in out.items() if v > 0}


class TimedSource:
    """Wraps a train_sd ``BatchSource`` (``sd.sources``): times each ``next()`` (the wait) and the time
    between batches (the step), and snapshots CPU by process class and per-core load
    at the first and last warm request. Everything else is the wrapped source's."""

    def __init__(self, inner: Any, steps: int, skip: int, tree: h.ProcTree, cores: tuple) -> None:
        self.inner, self.steps, self.skip, self.tree, self.cores = inner, steps, skip, tree, cores
        self.requests: list[float] = []  # perf_counter when the trainer asked for batch i
        self.got: list[float] = []  # ... and when it had it
        self.got_wall: list[float] = []  # time.time() of the same
        self.req_wall: list[float] = []  # time.time() of each request
        self.encoded_at: list[Optional[float]] = []  # when the batch's encoders ran (time.time(), pipelines)
        self.cpu: Optional[h.TreeSampler] = None
        self.core0: Optional[dict] = None
        self.window: dict = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batches(self) -> Any:
        from _scaleout_job import core_ticks, outside_by_core

        gen = self.inner.batches()
        try:
            while True:
                i = len(self.requests)
                if i == self.skip:
                    self.cpu = h.TreeSampler(self.tree)
                    self.cpu.step()
                    self.core0 = core_ticks()
                    self.threads0 = thread_ticks()
                    self.threads_seen = dict(self.threads0)
                    self.encode0 = getattr(self.inner, "encode_s", 0.0)
                if self.cpu is not None and i % 16 == 0:
                    # Processes and threads that end before the window does (a pool shut down once its
                    # epoch is made, an executor done) keep the ticks they had: refresh the known ones.
                    self.threads_seen.update(thread_ticks())
                    for pid in list(self.cpu.last_ticks):
                        st = h._read_stat(pid)
                        if st is not None:
                            self.cpu.last_ticks[pid] = st[1]
                self.requests.append(time.perf_counter())
                self.req_wall.append(time.time())
                if i == self.steps - 1 and self.cpu is not None:  # the window ends at the last request
                    self.cpu.step()
                    cls = self.cpu.cpu_s_by_class()
                    self.window = {"cpu_s_by_class": cls,
                                   "outside_by_core": outside_by_core(self.core0, core_ticks(), cls, *self.cores),
                                   "trainer_threads_cpu_s": thread_cpu_s(self.threads0,
                                                                         {**self.threads_seen, **thread_ticks()}),
                                   "encode_in_next_s": getattr(self.inner, "encode_s", 0.0) - self.encode0,
                                   "peak_pss_bytes_at_end": self.cpu.peak_pss}
                batch = next(gen)
                self.got.append(time.perf_counter())
                self.got_wall.append(time.time())
                enc = batch.get("encoded_at") if isinstance(batch, dict) else None
                self.encoded_at.append(float(enc.min()) if enc is not None and len(enc) else None)
                yield batch
        finally:
            gen.close()

    def figures(self, batch_size: int) -> dict:
        """Figures over two windows, both from request ``skip`` (after start-up):

        - steady: up to the last request made while the pipeline was still encoding (the
          latest ``encoded_at`` of the epoch); after it the trainer only drains batches made
          ahead, which a long epoch would not have. The torch baseline encodes in the loop:
          its steady window is the whole one.
        - epoch: up to the epoch's last request (the drain included).
        CPU, threads and outside load are over the epoch window.
        """
        a, b = self.skip, len(self.requests) - 1
        if b - a < 2:
            raise RuntimeError(f"only {len(self.requests)} steps ran, need more than skip={self.skip} + 2")
        produced = [e for e in self.encoded_at if e is not None]
        end = b
        if produced:
            last_enc = max(produced)
            end = max([i for i in range(a, b + 1) if self.req_wall[i] <= last_enc] or [b])
        if end - a < max(20, (b - a) // 4):  # too short to say anything: keep the whole window
            end = b

        def window(lo: int, hi: int) -> dict:
            wall = self.requests[hi] - self.requests[lo]
            waits = [self.got[i] - self.requests[i] for i in range(lo, hi)]
            return {"samples_per_s": (hi - lo) * batch_size / wall, "stall_fraction": sum(waits) / wall,
                    "wall_s": wall, "steps": hi - lo,
                    "wait_ms_median": 1e3 * statistics.median(waits),
                    "wait_ms_p90": 1e3 * sorted(waits)[int(0.9 * (len(waits) - 1))]}

        steady, epoch = window(a, end), window(a, b)
        compute = [self.requests[i + 1] - self.got[i] for i in range(a, b)]
        n = (b - a) * batch_size
        cls = self.window.get("cpu_s_by_class", {})
        # Batches encoded before the trainer held its first one were made while core 0 was free of
        # training: a window of them would measure a buffer draining, not the pipeline.
        enc = [self.encoded_at[i] for i in range(a, end)]
        prefilled = sum(1 for e in enc if e is not None and e < self.got_wall[0]) / len(enc)
        return {
            "samples_per_s": steady["samples_per_s"], "stall_fraction": steady["stall_fraction"],
            "wait_ms_median": steady["wait_ms_median"], "wait_ms_p90": steady["wait_ms_p90"],
            "steady_steps": steady["steps"], "drain_steps": b - end, "steady": steady, "epoch": epoch,
            "epoch_samples_per_s": epoch["samples_per_s"], "epoch_stall_fraction": epoch["stall_fraction"],
            "warm_steps": b - a, "warm_wall_s": epoch["wall_s"],
            "encode_in_next_fraction": self.window.get("encode_in_next_s", 0.0) / epoch["wall_s"],
            "step_compute_ms_median": 1e3 * statistics.median(compute),
            "first_batch_s": self.got[0] - self.requests[0],
            "prefilled_share": prefilled,
            "cpu_us_per_sample_by_class": {k: round(1e6 * v / n, 1) for k, v in cls.items() if v > 0},
            "cpu_us_per_sample": round(1e6 * sum(cls.values()) / n, 1) if cls else None,
            "outside_by_core": self.window.get("outside_by_core", {}),
            "trainer_threads_us_per_sample": {k: round(1e6 * v / n, 1) for k, v in
                                              self.window.get("trainer_threads_cpu_s", {}).items()},
        }

    @staticmethod
    def core_budget(fig: dict) -> dict:
        """Per training sample, µs: the wall time (= core 0's time), and what used core 0 and core 1:
        our processes, other processes (outside), and idle (the rest)."""
        wall = 1e6 / fig["epoch_samples_per_s"]  # the window the CPU figures are over
        cls = fig["cpu_us_per_sample_by_class"]
        out: dict[str, Any] = {"wall_us": round(wall, 1)}
        core0 = sum(v for k, v in cls.items() if not k.startswith("node2_")) + fig.get("sampler_us_per_sample", 0.0)
        for core, ours, key in (("core0", core0, "trainer_cores"),
                                ("core1", sum(v for k, v in cls.items() if k.startswith("node2_")), "node_cores")):
            o = fig["outside_by_core"].get(key)
            if o is None:
                continue
            out[core] = {"ours_us": round(ours, 1), "outside_us": round(o * wall, 1),
                         "idle_us": round(max(0.0, wall - ours - o * wall), 1)}
        return out


def timed_encoders() -> type:
    """``SDEncoders`` that also stamp each batch with the time it was encoded (``encoded_at``)."""
    import numpy as np
    from sd.encoders import SDEncoders

    class TimedSDEncoders(SDEncoders):
        def __call__(self, batch: dict) -> dict:
            out = super().__call__(batch)
            out["encoded_at"] = np.full(len(out["id"]), time.time())
            return out

    return TimedSDEncoders


def pipeline_source(cls: Any, args: Any, path: str, device: Any) -> Any:
    """A train_sd ``PipelineSource`` (or subclass) built with the time-stamping encoders."""
    import sd.sources

    orig = sd.sources.SDEncoders
    sd.sources.SDEncoders = timed_encoders()  # the name PipelineSource looks up while it builds the pipeline
    try:
        return cls(args, path, device)
    finally:
        sd.sources.SDEncoders = orig


def sd_args(cfg: dict, loader: str = "sbloader", workers: int = 1) -> Any:
    """train_sd's options for a contender. Under ``--format webdataset`` the Ray contenders read the
    shards; the torch baseline (train_sd's ``--loader torch``) reads the Parquet file of the same rows."""
    from sd.cli import parse_args

    fmt = cfg.get("format", "parquet") if loader == "sbloader" else "parquet"
    return parse_args([
        "--loader", loader, "--workers", str(workers), "--images", str(cfg["images"]), "--size", str(cfg["size"]),
        "--rows-per-group", str(cfg["rows_per_group"]), "--batch-size", str(cfg["batch_size"]),
        "--encode-batch", str(cfg["encode_batch"]), "--encoder-actors", "1", "--steps", str(cfg["steps"]),
        "--ckpt-every", str(cfg["steps"] + 1), "--keep-ckpts", "1", "--ckpt-dir", cfg["ckpt_dir"],
        "--data", cfg["data"], "--seed", "0", "--format", fmt,
        "--samples-per-shard", str(cfg.get("samples_per_shard", 256))])


def _raydata_preprocess_webdataset(batch: dict, **kwargs: Any) -> dict:
    """train_sd's ``preprocess_webdataset`` under Ray Data (see :func:`_raydata_preprocess`)."""
    from sd.data import preprocess_webdataset

    from sbloader.core.context import task_context

    from sd.data import webdataset_id

    with task_context(0, 0, webdataset_id(str(batch["__key__"][0]), kwargs["samples_per_shard"]), "preprocess", 0):
        return preprocess_webdataset(batch, **kwargs)


def _raydata_preprocess(batch: dict, **kwargs: Any) -> dict:
    """train_sd's ``preprocess`` under Ray Data: it draws from sbloader's task context, so give it one."""
    from sd.data import preprocess

    from sbloader.core.context import task_context

    with task_context(0, 0, int(batch["id"][0]), "preprocess", 0):
        return preprocess(batch, **kwargs)


def raydata_source(args: Any, path: str, block_kib: int) -> Any:
    """Ray Data's version of the pipeline, behind train_sd's ``BatchSource`` interface.

    At Ray Data's default block size (128 MiB) the 24 MiB file is one block: each stage
    would run every row before the next starts and the first batch wait for every
    encoding. So the target block size is set to ``block_kib`` (256 KiB: 48 rows)."""
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.target_max_block_size = block_kib * 1024
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    from sd.sources import BatchSource

    class RayDataSource(BatchSource):
        kind = "raydata"

        def __init__(self) -> None:
            kw = dict(size=args.size, max_tokens=args.max_tokens, vocab=args.vocab)
            if args.format == "webdataset":  # the shards, undecoded (decoder=None), as sbloader reads them
                # file_extensions: img2dataset's folder also holds .parquet and _stats.json files,
                # which Ray Data would otherwise open as tars ("invalid header")
                read = ray.data.read_webdataset(path, decoder=None, file_extensions=["tar"])
                fn = _raydata_preprocess_webdataset
                kw["samples_per_shard"] = args.samples_per_shard
            else:
                read, fn = ray.data.read_parquet(path, columns=["id", "image", "caption"]), _raydata_preprocess
            self.dataset = (
                read
                .map_batches(fn, batch_size=args.rows_per_group, num_cpus=1, batch_format="numpy", fn_kwargs=kw)
                .map_batches(timed_encoders(), batch_size=args.encode_batch, batch_format="numpy",
                             compute=ray.data.ActorPoolStrategy(size=args.encoder_actors),
                             num_cpus=args.encoder_cpus,
                             fn_constructor_kwargs=dict(vocab=args.vocab, max_tokens=args.max_tokens,
                                                        text_dim=args.text_dim, seed=args.encoder_seed))
            )

        def batches(self) -> Any:
            while True:
                yield from self.dataset.iter_torch_batches(batch_size=args.batch_size, drop_last=True)
                self.epoch += 1

        def state_dict(self) -> dict:
            return {"kind": self.kind, "epoch": self.epoch}

    return RayDataSource()


def allow_source(args: Any, path: str, device: Any) -> Any:
    """train_sd's pipeline, executed with ``allow_trainer_node=True`` (``to_dataloader`` has no such option)."""
    from sd.sources import PipelineSource

    from sbloader.loaders.batching import iter_batches, iter_blocks
    from sbloader.loaders.tensors import columns_to_torch as to_torch

    class AllowSource(PipelineSource):
        def batches(self) -> Any:
            while True:
                ex = self.dataset.execute(epoch=self.epoch, seed=args.seed, shuffle=True,
                                          deterministic=args.deterministic, allow_trainer_node=True)
                self.last_stats = ex.stats()
                blocks = iter_batches(iter_blocks(ex), args.batch_size, drop_last=True)
                try:
                    for b in blocks:
                        yield to_torch(b)
                finally:
                    blocks.close()
                self.epoch += 1

        def state_dict(self) -> dict:
            return {"kind": "sbloader_allow", "epoch": self.epoch}

    return pipeline_source(AllowSource, args, path, device)


def calibrate(cfg: dict) -> dict:
    """On this core, nothing else of ours running: CPU per sample of the decode stage
    (sbloader's batch function and the torch Dataset's ``__getitem__``), of the
    encoders (at the training batch), and the UNet step alone (wall and CPU)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from sd.data import ParquetCaptionDataset, dataset_path, preprocess, write_dataset
    from sd.denoiser import DDPM, TinyUNet, step_generator
    from sd.encoders import SDEncoders

    from sbloader.core.context import task_context

    args = sd_args(cfg, "torch")  # the Parquet file (under --format webdataset too: the same rows)
    path = write_dataset(dataset_path(args), args)
    g = cfg["rows_per_group"]
    t = pq.read_table(path, columns=["id", "image", "caption"]).slice(0, 12 * g)
    rows = {k: t.column(k).to_numpy(zero_copy_only=False) for k in ("id", "image", "caption")}
    kw = dict(size=args.size, max_tokens=args.max_tokens, vocab=args.vocab)

    blocks = [{k: v[s:s + g] for k, v in rows.items()} for s in range(0, 12 * g, g)]
    with task_context(0, 0, 0, "preprocess", 0):
        it = iter(blocks * 4)
        pre_cpu, pre_wall = h.timed_calls(lambda: preprocess(next(it), **kw), 10)
    ds = ParquetCaptionDataset(path, args.size, args.max_tokens, args.vocab, args.seed)
    order = iter(np.random.default_rng(0).permutation(len(ds)).tolist())
    item_cpu, item_wall = h.timed_calls(lambda: ds[(0, next(order))], 80)
    enc = SDEncoders(vocab=args.vocab, max_tokens=args.max_tokens, text_dim=args.text_dim,
                     seed=args.encoder_seed, device="cpu", where="trainer")
    with task_context(0, 0, 0, "preprocess", 0):
        b = preprocess(blocks[0], **kw)
    bs = args.batch_size
    sub = {k: v[:bs] for k, v in b.items()}
    enc_cpu, enc_wall = h.timed_calls(lambda: enc(sub), 10)
    out = enc(sub)
    torch.manual_seed(0)
    model = TinyUNet(base=args.base, text_dim=args.text_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddpm = DDPM()
    x0, ctx, mask = (torch.from_numpy(out[k]) for k in ("latents", "text_emb", "text_mask"))
    step = [0]

    def unet_step() -> None:
        loss = ddpm.loss(model, x0, ctx, mask, step_generator(0, 0, step[0], torch.device("cpu")),
                         args.cond_drop)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step[0] += 1

    unet_cpu, unet_wall = h.timed_calls(unet_step, 30)
    res = {
        "preprocess_cpu_ms_per_sample": 1e3 * pre_cpu / g, "preprocess_wall_ms_per_sample": 1e3 * pre_wall / g,
        "torch_getitem_cpu_ms_per_sample": 1e3 * item_cpu, "torch_getitem_wall_ms_per_sample": 1e3 * item_wall,
        "encode_cpu_ms_per_sample": 1e3 * enc_cpu / bs, "encode_wall_ms_per_sample": 1e3 * enc_wall / bs,
        "unet_step_cpu_ms": 1e3 * unet_cpu, "unet_step_wall_ms": 1e3 * unet_wall,
    }
    # Ideal rates from CPU time: one core doing everything (torch), or the UNet on core 0
    # while the node's core decodes and encodes (the 2-node pipelines).
    unet_s = res["unet_step_cpu_ms"] / 1e3 / bs
    res["unet_alone_samples_per_s"] = 1.0 / unet_s
    res["torch_ideal_samples_per_s"] = 1.0 / (unet_s + (res["torch_getitem_cpu_ms_per_sample"]
                                                        + res["encode_cpu_ms_per_sample"]) / 1e3)
    node_s = (res["preprocess_cpu_ms_per_sample"] + res["encode_cpu_ms_per_sample"]) / 1e3
    res["node_alone_samples_per_s"] = 1.0 / node_s
    res["two_node_ideal_samples_per_s"] = 1.0 / max(unet_s, node_s)
    return res


def run_contender(name: str, cfg: dict, make_source: Any, tree: h.ProcTree, cores: tuple,
                  loader: str = "sbloader", workers: int = 1) -> dict:
    import torch
    from sd.data import dataset_path
    from sd.loop import train

    args = sd_args(cfg, loader, workers)
    path = dataset_path(args)
    device = torch.device("cpu")
    timed: Optional[TimedSource] = None
    t0 = time.perf_counter()
    with h.measure(name, tree=tree, interval_s=cfg["pss_interval_s"]) as m:
        src = make_source(args, path, device)
        timed = TimedSource(src, args.steps, cfg["skip"], tree, cores)
        r = train(args, 0, 1, device, source=timed)
    res = m.result.as_dict()
    run_wall = time.perf_counter() - t0
    fig = timed.figures(args.batch_size)
    # The harness's PSS sampler thread runs in the trainer process: take it out (measured by thread).
    cls, th = fig["cpu_us_per_sample_by_class"], fig["trainer_threads_us_per_sample"]
    sampler_us = th.pop("harness-tree", 0.0)
    if "trainer" in cls:
        cls["trainer"] = round(max(0.0, cls["trainer"] - sampler_us), 1)
        fig["cpu_us_per_sample"] = round(sum(cls.values()), 1)
    fig["sampler_us_per_sample"] = sampler_us
    fig["core_budget"] = TimedSource.core_budget(fig)
    head_w, node_w = cls.get("workers", 0.0), cls.get("node2_workers", 0.0)
    fig["pipeline_on_core0"] = head_w / (head_w + node_w) if loader == "sbloader" and head_w + node_w > 0 else None
    st = src.loader.stats() if hasattr(src, "loader") and hasattr(src.loader, "stats") else getattr(
        src, "last_stats", None)
    if st is not None:  # sbloader's own account of the epoch
        fig["sbloader_stats"] = {"memory_budget": st.memory_budget, "peak_held_bytes": st.peak_held_bytes,
                                 "first_block_s": st.first_block_s, "stall_s": st.stall_s,
                                 "operators": [{"name": o.name, "tasks": o.tasks, "rows": o.rows,
                                                "task_s": round(o.task_s, 3), "throttled_s": round(o.throttled_s, 3)}
                                               for o in st.operators]}
    run_samples = args.steps * args.batch_size
    fig["run_cpu_us_per_sample_by_class"] = {k: round(1e6 * v / run_samples, 1)
                                             for k, v in res["cpu_s_by_class"].items() if v > 0}
    fig.update(contender=name, run_wall_s=run_wall, peak_pss_bytes=res["peak_pss_bytes"],
               peak_pss_by_class=res["peak_pss_by_class"], processes_at_peak=res["processes_at_peak"],
               run_outside_cpu_frac=res["outside_cpu_frac"], sampler_cpu_s=res["sampler_cpu_s"],
               trainer_first_batch_s=r["first_batch_s"], last_loss=r["losses"].get(str(r["step"])),
               encoder_pids=r["encoder_pids"], loader_summary=r["loader_summary"],
               loader_stalls=r["loader_stalls"], encode_in_trainer_s=r["encode_in_trainer_s"])
    del src, timed
    gc.collect()
    print(f"    {name}: {fig['samples_per_s']:.0f} samples/s, stall {100 * fig['stall_fraction']:.0f}%, "
          f"prefilled {100 * fig['prefilled_share']:.0f}%, first batch {fig['first_batch_s']:.1f}s, "
          f"step compute {fig['step_compute_ms_median']:.1f} ms, outside {fig['outside_by_core']}", flush=True)
    return fig


def wait_cpus_free(timeout: float = 30.0) -> float:
    """Until every logical CPU of the cluster is free again (a finished pool's actors gone)."""
    import ray

    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0) - 1e-6:
            break
        time.sleep(0.25)
    return time.perf_counter() - t


def _on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwind: the finally blocks stop the node and Ray


def stop_leftover_nodes(pids_file: str) -> list[int]:
    """Extra nodes a job started and did not stop (it was killed): their sessions, by pid."""
    try:
        pids = [int(x) for x in Path(pids_file).read_text().split()]
    except (OSError, ValueError):
        return []
    left = [p for p in pids if "_scaleout_node.py" in h.cmdline(p)]
    tree = h.descendants(left)  # Ray's workers of the node run in sessions of their own
    for p in left:
        try:
            os.killpg(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any("_scaleout_node.py" in h.cmdline(p) for p in left):
        time.sleep(0.5)
    for p in tree:  # only processes of the node we started
        if h._read_stat(p) is not None:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return left


def job_main(job: str, cfg: dict, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from sd.sources import PipelineSource, TorchSource

    cores = sorted(os.sched_getaffinity(0))
    result: dict[str, Any] = {"job": job, "trainer_cores": cores, "contenders": {}}
    order = cfg["order"]
    if job == "torch":
        result["calibration"] = calibrate(cfg)
        tree = h.ProcTree(ray=False)
        for name in order:
            w = int(name[len("torch_w"):])
            result["contenders"][name] = run_contender(
                name, cfg, lambda a, p, d: TorchSource(a, p, 0, 1, d), tree, (cores, []),
                loader="torch", workers=w)
        Path(out).write_text(json.dumps(result, default=str))
        return
    import ray

    import sbloader
    from _scaleout_job import ClusterTree, is_loopback, listening_addresses, start_node, stop_node, wait_nodes

    k = cfg["extra_nodes"]
    t = time.perf_counter()
    info = sbloader.init(num_cpus=cfg["head_cpus"], object_store_memory=cfg["store_mib"] * 2**20)
    result["head_start_s"] = time.perf_counter() - t
    signal.signal(signal.SIGTERM, _on_term)  # Ray's driver installed its own: unwind through ours
    nodes = []
    try:
        t = time.perf_counter()
        for i in range(k):
            nodes.append(start_node(info.address, cfg["node_cores"][i], cfg["node_cpus"], cfg["store_mib"] * 2**20,
                                    f"{out}.node{i}.log"))
            Path(f"{out}.nodes").write_text(" ".join(str(n.pid) for n in nodes))  # for the driver, if we die
        wait_nodes(1 + k)
        result["nodes_join_s"] = time.perf_counter() - t
        result["nodes"] = [{"node_id": x["NodeID"][:12], "cpus": x["Resources"].get("CPU"),
                            "address": x["NodeManagerAddress"], "head": x["NodeID"] == info.node_id}
                           for x in ray.nodes() if x.get("Alive")]
        node_pids = h.descendants([n.pid for n in nodes])
        result["node_listening"] = listening_addresses(node_pids) if nodes else []
        bad = [a for a in result["node_listening"] if not is_loopback(a)]
        if bad:
            raise RuntimeError(f"an extra node listens on non-loopback addresses {bad}; stopping")
        tree = ClusterTree(extra_roots=tuple(n.pid for n in nodes))
        core_groups = (cores, [int(c) for c in cfg["node_cores"][:k]])
        makers = {"sbloader": lambda a, p, d: pipeline_source(PipelineSource, a, p, d),
                  "sbloader_1node": lambda a, p, d: pipeline_source(PipelineSource, a, p, d),
                  "sbloader_allow": allow_source,
                  "raydata": lambda a, p, d: raydata_source(a, p, cfg["raydata_block_kib"])}
        time.sleep(1.0)
        for name in order:
            result.setdefault("cpus_free_wait_s", {})[name] = wait_cpus_free()
            result["contenders"][name] = run_contender(name, cfg, makers[name], tree, core_groups)
    finally:
        result["stopped"] = [stop_node(n) for n in nodes]
        sbloader.shutdown()
    Path(out).write_text(json.dumps(result, default=str))


# =====================================================================================
# The driver: rounds of jobs, figures, report
# =====================================================================================


def run_job(job: str, cfg: dict, args: argparse.Namespace) -> dict:
    fd, out = tempfile.mkstemp(prefix=f"bench_sd_{job}_", suffix=".json")
    os.close(fd)
    cfg_path = out + ".cfg"
    Path(cfg_path).write_text(json.dumps(cfg))
    cmd = ["taskset", "-c", args.trainer_cores, sys.executable, str(Path(__file__).resolve()), "--job", job,
           "--job-config", cfg_path, "--job-out", out]
    env = _jobs.job_env(TRAINERS, REPO)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # even where the caller's environment says otherwise
    env.pop("RAY_ADDRESS", None)
    env["OMP_NUM_THREADS"] = "1"
    env["TQDM_DISABLE"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.job_timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the job's handler unwinds, stopping the extra node it started (its own session).
        os.kill(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        stderr += f"\n[bench_sd] job {job} ran past --job-timeout {args.job_timeout:.0f}s and was stopped"
    wall = time.perf_counter() - t0
    for line in stdout.splitlines():
        if line.startswith("    "):
            print(line, flush=True)
    try:
        res = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        res = None
    leftover = stop_leftover_nodes(f"{out}.nodes")
    if leftover:
        stderr += f"\n[bench_sd] stopped extra node(s) the job left running: {leftover}"
    for f in [out, cfg_path, f"{out}.nodes"] + [f"{out}.node{i}.log" for i in range(4)]:
        try:
            os.unlink(f)
        except OSError:
            pass
    if proc.returncode != 0 or res is None:
        raise RuntimeError(f"job {job} failed (rc={proc.returncode}):\n{stdout[-3000:]}\n{stderr[-4000:]}")
    res["job_wall_s"] = wall
    return res


def outside(fig: dict) -> float:
    """The larger share of a pinned core that processes not ours took during the warm window."""
    return max([v for v in fig["outside_by_core"].values() if v is not None] or [0.0])


def rotate(xs: list, r: int) -> list:
    if not xs:
        return xs
    return xs[r % len(xs):] + xs[: r % len(xs)]


def summarize_rounds(rounds: list[dict]) -> dict:
    """Per contender: median (min–max) over rounds of each figure; the ratios in the same round."""
    out: dict[str, Any] = {}
    for c in CONTENDERS:
        figs = [r[c] for r in rounds if c in r]
        if not figs:
            continue
        classes = sorted({k for f in figs for k in f["cpu_us_per_sample_by_class"]})
        out[c] = {
            "samples_per_s": h.summarize([f["samples_per_s"] for f in figs]),
            "stall_fraction": h.summarize([f["stall_fraction"] for f in figs]),
            "encode_in_next_fraction": h.summarize([f.get("encode_in_next_fraction", 0.0) for f in figs]),
            "wait_ms_median": h.summarize([f["wait_ms_median"] for f in figs]),
            "wait_ms_p90": h.summarize([f["wait_ms_p90"] for f in figs]),
            "step_compute_ms_median": h.summarize([f["step_compute_ms_median"] for f in figs]),
            "first_batch_s": h.summarize([f["first_batch_s"] for f in figs]),
            "prefilled_share": h.summarize([f["prefilled_share"] for f in figs]),
            "pipeline_on_core0": h.summarize([f.get("pipeline_on_core0") for f in figs]),
            "peak_pss_bytes": h.summarize([f["peak_pss_bytes"] for f in figs]),
            "cpu_us_per_sample": h.summarize([f["cpu_us_per_sample"] for f in figs]),
            "epoch_samples_per_s": h.summarize([f.get("epoch_samples_per_s") for f in figs]),
            "epoch_stall_fraction": h.summarize([f.get("epoch_stall_fraction") for f in figs]),
            "drain_steps": h.summarize([f.get("drain_steps") for f in figs]),
            "run_cpu_us_per_sample": h.summarize([sum(f["run_cpu_us_per_sample_by_class"].values()) for f in figs
                                                  if "run_cpu_us_per_sample_by_class" in f]),
            "cpu_us_per_sample_by_class": {k: h.summarize([f["cpu_us_per_sample_by_class"].get(k, 0.0) for f in figs])
                                           for k in classes},
            "outside_core0": h.summarize([f["outside_by_core"].get("trainer_cores") for f in figs]),
            "outside_core1": h.summarize([f["outside_by_core"].get("node_cores") for f in figs]),
            "trainer_threads_us_per_sample": {
                k: h.summarize([f["trainer_threads_us_per_sample"].get(k, 0.0) for f in figs])
                for k in sorted({k for f in figs for k in f["trainer_threads_us_per_sample"]})},
            "core_budget": {
                "wall_us": h.summarize([f["core_budget"]["wall_us"] for f in figs]),
                **{core: {k: h.summarize([f["core_budget"][core][k] for f in figs if core in f["core_budget"]])
                          for k in ("ours_us", "outside_us", "idle_us")}
                   for core in ("core0", "core1") if any(core in f["core_budget"] for f in figs)}},
        }
    for r in rounds:
        ran = [c for c in TORCH if c in r]
        r["torch_best"] = max(ran, key=lambda c: r[c]["samples_per_s"]) if ran else None
    out["ratios_vs_torch_best"] = {
        c: h.summarize([r[c]["samples_per_s"] / r[r["torch_best"]]["samples_per_s"] for r in rounds
                        if c in r and r["torch_best"]])
        for c in CONTENDERS if c in out}
    out["epoch_ratios_vs_torch_best"] = {
        c: h.summarize([r[c]["epoch_samples_per_s"] / r[r["torch_best"]]["epoch_samples_per_s"] for r in rounds
                        if c in r and r["torch_best"] and "epoch_samples_per_s" in r[c]])
        for c in CONTENDERS if c in out}
    out["torch_best_per_round"] = [r["torch_best"] for r in rounds]
    return out


def _median_at(d: Any, *keys: str) -> float:
    """The median at ``d[k1][k2]...`` of a summary (0 where absent)."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return 0.0
        d = d[k]
    return float(d.get("median") or 0.0) if isinstance(d, dict) else 0.0


def reading(s: dict, cal: dict, bs: int) -> list[str]:
    """Where the time goes, in words, from this run's medians."""
    unet_us = 1e3 * _median_at(cal, "unet_step_cpu_ms") / bs
    enc_us = 1e3 * _median_at(cal, "encode_cpu_ms_per_sample")
    pre_us = 1e3 * _median_at(cal, "preprocess_cpu_ms_per_sample")
    out = []
    tb = max((c for c in TORCH if c in s), key=lambda c: _median_at(s[c], "samples_per_s"), default=None)
    if tb:
        d = s[tb]
        out.append(
            f"- `{tb}`: core 0 does everything: {_median_at(d, 'core_budget', 'core0', 'ours_us'):.0f} µs of our CPU "
            f"per sample (trainer {_median_at(d, 'cpu_us_per_sample_by_class', 'trainer'):.0f}: the UNet step, "
            f"~{unet_us:.0f} alone, plus the encoders, ~{enc_us:.0f}; DataLoader workers "
            f"{_median_at(d, 'cpu_us_per_sample_by_class', 'workers'):.0f}: decode, ~{pre_us:.0f} in a batch function, "
            f"plus collation and the copy to the trainer). Of its stall fraction "
            f"({100 * _median_at(d, 'stall_fraction'):.0f}%), {100 * _median_at(d, 'encode_in_next_fraction'):.0f} points are "
            "the encoders running in the trainer inside `next()`, the rest waiting for the workers' decode.")
    for c in ("sbloader", "sbloader_allow", "raydata", "sbloader_1node"):
        if c not in s:
            continue
        d = s[c]
        cls, th = d["cpu_us_per_sample_by_class"], d["trainer_threads_us_per_sample"]
        head = sum(_median_at(v) for k, v in cls.items() if k not in ("trainer",) and not k.startswith("node2_"))
        node = sum(_median_at(v) for k, v in cls.items() if k.startswith("node2_"))
        main = _median_at(th, "main")
        execu = _median_at(th, "sbloader-executor")
        other = sum(_median_at(v) for k, v in th.items() if k not in ("main", "sbloader-executor"))
        idle0 = _median_at(d, "core_budget", "core0", "idle_us")
        wall = _median_at(d, "core_budget", "wall_us")
        line = (f"- `{c}`: {wall:.0f} µs per sample of wall time; on core 0 the trainer's main thread takes "
                f"{main:.0f} µs (the training step and `next()`; the UNet step alone took ~{unet_us:.0f} in the "
                "calibration)")
        if execu:
            line += f", sbloader's executor thread {execu:.0f}"
        line += (f", the trainer's other threads (Ray core worker, gRPC, ...) {other:.0f}, the head's Ray processes "
                 f"{head:.0f} (its workers {_median_at(cls, 'workers'):.0f})")
        if "core1" in d["core_budget"]:
            line += (f"; core 1 (the node) {node:.0f} µs of our CPU per sample (decode + encode "
                     f"~{pre_us + enc_us:.0f} in the calibration), "
                     f"idle {_median_at(d, 'core_budget', 'core1', 'idle_us'):.0f}")
        line += f". Core 0 idle: {idle0:.0f} µs per sample."
        out.append(line)
    return out


def report(args: argparse.Namespace, cfg: dict, rounds: list[dict], cals: list[dict],
           jobs: list[dict]) -> tuple[dict, str]:
    s = summarize_rounds(rounds)
    ratios = s["ratios_vs_torch_best"]
    cal = {k: h.summarize([c[k] for c in cals]) for k in cals[0]}
    target = args.target
    main_ratio = ratios.get("sbloader", {}).get("median")
    met = main_ratio is not None and main_ratio >= target
    rows = []
    for c in CONTENDERS:
        if c not in s:
            continue
        d = s[c]
        rows.append({
            "contender": f"`{c}`: {DISPLAY[c]}",
            "samples/s": h.fmt_range(d["samples_per_s"], "{:.0f}"),
            "x torch best (same round)": h.fmt_range(ratios[c], "{:.2f}"),
            "whole epoch: samples/s, x torch": f"{h.fmt_range(d['epoch_samples_per_s'], '{:.0f}')}, "
                                               f"{h.fmt_range(s['epoch_ratios_vs_torch_best'][c], '{:.2f}')}",
            "drain steps": h.fmt_range(d["drain_steps"], "{:.0f}") if c not in TORCH else "–",
            "stall fraction % (steady / epoch)": (
                f"{h.fmt_range(d['stall_fraction'], '{:.0f}', 100)} / "
                f"{h.fmt_range(d['epoch_stall_fraction'], '{:.0f}', 100).split(' ')[0]}"),
            "wait ms median / p90": f"{h.fmt_range(d['wait_ms_median'], '{:.1f}')} / "
                                    f"{h.fmt_range(d['wait_ms_p90'], '{:.1f}')}",
            "step compute ms": h.fmt_range(d["step_compute_ms_median"], "{:.1f}"),
            "first batch s": h.fmt_range(d["first_batch_s"], "{:.2f}"),
            "prefilled %": h.fmt_range(d["prefilled_share"], "{:.0f}", 100) if c not in TORCH else "–",
            "pipeline work on core 0 %": (h.fmt_range(d["pipeline_on_core0"], "{:.0f}", 100)
                                          if c not in TORCH else "100"),
            "peak PSS MiB": h.fmt_range(d["peak_pss_bytes"], "{:.0f}", 2**-20),
            "outside % core 0 / core 1": f"{h.fmt_range(d['outside_core0'], '{:.0f}', 100)} / "
                                         f"{h.fmt_range(d['outside_core1'], '{:.0f}', 100)}",
        })
    cpu_rows = []
    classes = sorted({k for c in CONTENDERS if c in s for k in s[c]["cpu_us_per_sample_by_class"]},
                     key=lambda x: (x.startswith("node2_"), x))
    for c in CONTENDERS:
        if c not in s:
            continue
        d = s[c]["cpu_us_per_sample_by_class"]
        cpu_rows.append({"contender": c, **{k: h.fmt_range(d[k], "{:.0f}") for k in d if (d[k]["median"] or 0) >= 1},
                         "total": h.fmt_range(s[c]["cpu_us_per_sample"], "{:.0f}"),
                         "whole run (start-up incl.)": h.fmt_range(s[c]["run_cpu_us_per_sample"], "{:.0f}")})
    budget_rows = []
    thread_names: set = set()
    for c in CONTENDERS:
        if c in s:
            thread_names |= {k for k, v in s[c]["trainer_threads_us_per_sample"].items() if (v["median"] or 0) >= 20}
    thread_names_l = ["main"] + sorted(thread_names - {"main"})
    for c in CONTENDERS:
        if c not in s:
            continue
        b = s[c]["core_budget"]
        th = s[c]["trainer_threads_us_per_sample"]
        shown = sum((th[k]["median"] or 0) for k in thread_names_l if k in th)
        rest = sum((v["median"] or 0) for v in th.values()) - shown
        row = {"contender": c, "wall = core 0 µs": h.fmt_range(b["wall_us"], "{:.0f}")}
        for core in ("core0", "core1"):
            if core in b:
                row[f"{core} ours / outside / idle"] = " / ".join(
                    h.fmt_range(b[core][k], "{:.0f}").split(" ")[0] for k in ("ours_us", "outside_us", "idle_us"))
            else:
                row[f"{core} ours / outside / idle"] = "–"
        for k in thread_names_l:
            row[f"trainer: {k}"] = h.fmt_range(th[k], "{:.0f}").split(" ")[0] if k in th else ""
        row["trainer: other threads"] = f"{rest:.0f}"
        budget_rows.append(row)
    budget_cols = list(budget_rows[0].keys()) if budget_rows else []
    round_rows = []
    for c in CONTENDERS:
        if not any(c in r for r in rounds):
            continue
        row = {"contender": c}
        for i, r in enumerate(rounds):
            f = r.get(c)
            if f is None:
                continue
            o = f["outside_by_core"]
            on0 = f.get("pipeline_on_core0")
            row[f"round {i}"] = (f"{f['samples_per_s']:.0f}" + (" (make-up)" if "makeup_of_outside" in f else "")
                                 + f"; outside {100 * (o.get('trainer_cores') or 0):.0f}"
                                 + (f"/{100 * o['node_cores']:.0f}" if o.get("node_cores") is not None else "") + "%"
                                 + (f"; on core 0 {100 * on0:.0f}%" if on0 is not None else ""))
        round_rows.append(row)
    round_cols = ["contender"] + [f"round {i}" for i in range(len(rounds))]
    sb = [r["sbloader"]["sbloader_stats"] for r in rounds if "sbloader_stats" in r.get("sbloader", {})]
    budget = max((x["memory_budget"] for x in sb), default=0)
    held = max((x["peak_held_bytes"] for x in sb), default=0)
    per_image = 3 * cfg["size"] ** 2 + 8 * 16  # a decoded image and its tokens
    ideal_ratio = h.summarize([c["two_node_ideal_samples_per_s"] / c["torch_ideal_samples_per_s"] for c in cals])
    makeups = [j for j in jobs if j.get("makeup")]
    md = [
        f"## Verdict: sbloader / torch DataLoader = {h.fmt_range(ratios.get('sbloader', {}), '{:.2f}')} "
        f"(target {target}x): **{'met' if met else 'NOT met'}**",
        "",
        f"The trainer node's one core (core {args.trainer_cores}) is the bottleneck; a CPU node (core "
        f"{cfg['node_cores'][0]}) is added for the Ray contenders. `x torch best` divides by the better of torch's "
        "1- and 2-worker runs of the same round.",
        "",
        f"Workload: `trainers/train_sd.py`'s own training loop (`sd.loop.train`), {cfg['images']} generated "
        f"images + captions in Parquet (row groups of {cfg['rows_per_group']}), {cfg['size']} px, batch "
        f"{cfg['batch_size']}, encoder blocks of {cfg['encode_batch']}, one encoder actor, UNet base 32 on CPU, "
        f"each run one epoch ({cfg['steps']} steps), a new iterator as users run them; figures over steps "
        f"{cfg['skip'] + 1}–{cfg['steps'] - 1} (the epoch after its start-up). "
        f"{args.rounds} round(s), the contenders interleaved (jobs and the contenders in them rotate each round); "
        "median (min–max) over rounds. A run where other processes took more than "
        f"{100 * args.max_outside:.0f}% of a pinned core got one make-up run and the quieter of the two is kept "
        f"({len(makeups)} make-up job(s) in this run).",
        "",
        h.markdown_table(rows),
        "",
        "**Bounds from the calibration** (each round, on core 0, CPU time, nothing else of ours running): "
        f"UNet step alone {h.fmt_range(cal['unet_step_cpu_ms'], '{:.1f}')} ms "
        f"(wall {h.fmt_range(cal['unet_step_wall_ms'], '{:.1f}')} ms) = "
        f"{h.fmt_range(cal['unet_alone_samples_per_s'], '{:.0f}')} samples/s when data is free; decode stage "
        f"{h.fmt_range(cal['preprocess_cpu_ms_per_sample'], '{:.2f}')} ms/sample (sbloader's batch function), "
        f"{h.fmt_range(cal['torch_getitem_cpu_ms_per_sample'], '{:.2f}')} ms (torch Dataset `__getitem__`, random "
        f"order); encoders {h.fmt_range(cal['encode_cpu_ms_per_sample'], '{:.2f}')} ms/sample at batch "
        f"{cfg['batch_size']}. Ideal rates: one core doing everything (torch) "
        f"{h.fmt_range(cal['torch_ideal_samples_per_s'], '{:.0f}')} samples/s; the node's core alone (decode + "
        f"encode) {h.fmt_range(cal['node_alone_samples_per_s'], '{:.0f}')}; two nodes, UNet on core 0 and the rest "
        f"on the node, {h.fmt_range(cal['two_node_ideal_samples_per_s'], '{:.0f}')} samples/s, i.e. an ideal "
        f"ratio of {h.fmt_range(ideal_ratio, '{:.2f}')}x.",
        "",
        "- samples/s (steady; the verdict's figure): training samples per second from the trainer's request for "
        "batch `skip` (after start-up) to its last request made while the pipeline was still encoding (the "
        "latest encoding time stamped on the epoch's batches). After that the trainer only drains batches the "
        "pipeline made ahead (`drain steps`), a bonus a long epoch would not have. The torch baseline encodes in "
        "its loop, so its steady window is the whole one. `whole epoch`: the same up to the epoch's last batch, "
        "the drain included (what a user gets from an epoch this short).",
        "- stall fraction: the time the training loop spent in `next()` for its next batch / wall, over the same "
        "steps. For torch that includes encoding the batch in the trainer (the baseline does it inside its "
        "iterator; it is work the loader left to the trainer's core).",
        "- step compute: the median time from holding a batch to asking for the next (the UNet step with "
        "whatever else shares core 0).",
        "- first batch: the first `next()` of the run (start-up included: pools, workers, Ray Data's planning).",
        "- prefilled: the share of the warm window's batches that the encoders finished before the trainer held "
        "its first batch (made while core 0 was free of training); a large share would mean the window measured "
        "a buffer draining, not the pipeline keeping up.",
        *([f"- sbloader's memory budget here: {budget / 2**20:.0f} MiB (a quarter of the cluster's object "
           f"stores, room for about {budget // per_image:,} decoded images of {per_image / 1024:.0f} KiB); its "
           f"executor held at most {held / 2**20:.0f} MiB (about {held // per_image:,} images' worth) in a run."]
          if budget else []),
        "- pipeline work on core 0: the Ray workers' CPU on the trainer's core / all Ray workers' CPU (the "
        "rest ran on the node), i.e. where the decode tasks and the encoder actor landed.",
        "- peak PSS: over the whole run, summed over the process tree (trainer, DataLoader workers; head Ray's "
        "daemons and workers; the extra node's raylet, store, agents and workers).",
        "- outside %: share of each pinned core taken by processes not ours during the warm window (other "
        "sessions share this machine).",
        "",
        "## Every round",
        "",
        "samples/s; the share of core 0 / core 1 other processes took; where the pipeline's Ray workers ran "
        "(their CPU on core 0). `(make-up)`: the kept run is the make-up of a disturbed one.",
        "",
        h.markdown_table(round_rows, round_cols),
        "",
        "## CPU µs per training sample by process (warm window)",
        "",
        h.markdown_table(cpu_rows, ["contender"] + classes + ["total", "whole run (start-up incl.)"]),
        "",
        "`total` is over the warm window, all processes; `whole run` divides the CPU of the whole run (the "
        "pipeline's start-up, actor construction and Ray Data's planning included) by the epoch's samples. "
        "`trainer` = the training process (the harness's sampler thread taken out); `workers` = DataLoader workers "
        "(torch) or the head's Ray workers (core 0); `raylet`, `gcs`, `ray_daemons` = the head's; `node2_*` = the "
        "extra node's processes (core 1).",
        "",
        "## Where core 0's time goes (µs per training sample, warm window)",
        "",
        *reading(s, cal, cfg["batch_size"]),
        "",
        "Core 0 is the trainer node's only core, so its time per sample is the wall time per sample. `ours` = "
        "our processes on it (trainer, DataLoader workers or the head's Ray processes, the measuring thread); "
        "`outside` = other sessions' processes; `idle` = the rest (core 0 waited). Core 1 (the CPU node) the same "
        "way. The trainer process is split by thread: `main` runs the training step and `next()` (and, for torch, "
        "the encoders); `sbloader-executor` is sbloader's scheduling loop; the rest are Ray's, gRPC's, torch's "
        "and pyarrow's threads.",
        "",
        h.markdown_table(budget_rows, budget_cols),
        "",
        "## The contenders",
        "",
        *([f"**Read from WebDataset shards** (`--format webdataset`): the same rows as img2dataset-style shards "
           f"of {cfg.get('samples_per_shard')} samples (`<key>.jpg`, `.txt`, `.json`). The Ray contenders read them "
           "(`sbloader`: `read_webdataset(folder, decode=False, samples_per_partition=16)` -> "
           "`preprocess_webdataset`; `raydata`: `ray.data.read_webdataset(folder, decoder=None, "
           "file_extensions=['tar'])` -> the same); "
           "the torch baseline reads the Parquet file of the same rows. Read `read_parquet` below as that.", ""]
          if cfg.get("format") == "webdataset" else []),
        "- `torch_w1`/`torch_w2`: `sd.sources.TorchSource` as `--loader torch` builds it: a map-style Dataset over "
        "the Parquet file (row groups read on demand, a few cached per worker), `DataLoader(batch_size=8, "
        "num_workers=1|2, persistent_workers=True)`, the encoders called on each batch in the trainer.",
        "- `sbloader`: `sd.sources.PipelineSource` as `--loader sbloader` builds it: `read_parquet(file)` (a "
        f"partition per row group) -> `map_batches(preprocess, num_cpus=1)` -> `map_batches(SDEncoders, "
        f"batch_size={cfg['encode_batch']}, concurrency=(1, 1), num_cpus=1)` -> `to_dataloader(8, shuffle=True, "
        "seed=0, drop_last=True, deterministic=True)`.",
        "- `sbloader_allow`: the same Dataset through `Dataset.execute(shuffle=True, deterministic=True, "
        "allow_trainer_node=True)` and sbloader's own `iter_batches`/`to_torch` (`to_dataloader` has no "
        "`allow_trainer_node` option).",
        "- `raydata`: `ray.data.read_parquet(file)` -> `map_batches(preprocess, batch_size=16, num_cpus=1)` -> "
        f"`map_batches(SDEncoders, batch_size={cfg['encode_batch']}, compute=ActorPoolStrategy(size=1), "
        "num_cpus=1)` -> `iter_torch_batches(batch_size=8, drop_last=True)`, no shuffle (its file-level shuffle "
        "has one file to shuffle). Ray Data fuses the two map stages into the actor. At its default block size "
        "(128 MiB) the 24 MiB file is one block and each stage runs every row before the next starts (the first "
        f"batch then waits for the whole dataset's encoding), so `DataContext.target_max_block_size` is set to "
        f"{cfg['raydata_block_kib']} KiB (about 48 rows a block). `preprocess` draws its crops from sbloader's "
        "task context, so Ray Data's calls run inside one (`sbloader.core.context.task_context`).",
        "- Every pipeline's encoders are `SDEncoders` with one addition: they stamp each batch with the time it "
        "was encoded (the `prefilled` check).",
        "",
        "## Setup (emulated by CPU affinity on one host)",
        "",
        f"- Trainer node: the training process and the head Ray (`sbloader.init(num_cpus={cfg['head_cpus']})`: raylet, "
        f"GCS, daemons, workers) pinned to core {args.trainer_cores} with `taskset`; the torch baseline runs there "
        "alone (no Ray).",
        f"- CPU node: a Ray worker node (`_scaleout_node.py`: its own raylet, object store and agents; "
        f"`--num-cpus={cfg['node_cpus']}`) pinned to core {cfg['node_cores'][0]}, joined over loopback with the "
        "head's auth token (listening addresses checked: "
        f"{', '.join(next((j.get('node_listening') for j in jobs if j.get('node_listening')), []) or ['–'])}).",
        "- Logical CPUs: the head advertises 1 (its one core); the node advertises 2 on its one core so the "
        "encoder actor (1 logical CPU) and a decode task (1) can both be placed; the no-extra-node job's head "
        "advertises 2 for the same reason. The physical limit is the pinning. (With the node at 1 logical CPU, "
        "sbloader's default placement hangs: the pool's one actor holds the node's only CPU, the decode tasks may "
        "not use the trainer's node, and no stuck warning fires, because the warning counts the trainer node's "
        "free CPU as available. Seen while building this benchmark; a job timeout stops such a run.)",
        "- Objects between the nodes go through the two object stores over loopback (real copies and gRPC, no "
        "network latency or bandwidth limit); both nodes share one memory bus and L3. A real second machine adds "
        "the network and removes the shared caches.",
        "- Other sessions' processes run on both cores (outside % above): taskset pins ours, not theirs.",
    ]
    payload = {"args": vars(args), "config": cfg, "calibration": cals, "summary": s, "rounds": rounds,
               "target": target, "target_met": met, "jobs": jobs}
    return payload, "\n".join(md)


def plot(s: dict, cals: list[dict], path: Path, target: float) -> Optional[Path]:
    plt = h.pyplot()
    if plt is None:
        return None
    names = [c for c in CONTENDERS if c in s]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    med = [s[c]["samples_per_s"]["median"] for c in names]
    lo = [m - s[c]["samples_per_s"]["min"] for m, c in zip(med, names)]
    hi = [s[c]["samples_per_s"]["max"] - m for m, c in zip(med, names)]
    colors = ["#999999" if c.startswith("torch") else "#d08040" if c == "raydata" else "#3070b0" for c in names]
    ax1.bar(range(len(names)), med, yerr=[lo, hi], color=colors, capsize=3)
    ratios = s.get("ratios_vs_torch_best", {})
    for i, c in enumerate(names):
        if ratios.get(c, {}).get("median") is not None:
            ax1.text(i, med[i] + hi[i], f"{ratios[c]['median']:.2f}x", ha="center", va="bottom", fontsize=7)
    ep = [s[c].get("epoch_samples_per_s", {}).get("median") for c in names]
    ax1.plot([i for i, v in enumerate(ep) if v], [v for v in ep if v], "k_", ms=18, mew=2,
             label="whole epoch (drain included)")
    tb = [s[c]["samples_per_s"]["median"] for c in TORCH if c in s]
    if tb:
        ax1.axhline(target * max(tb), color="#3070b0", ls="-.", lw=1, label=f"target: {target}x torch's better")
    for name, key, style in (("UNet alone (data free)", "unet_alone_samples_per_s", "-"),
                             ("ideal, 2 nodes", "two_node_ideal_samples_per_s", "--"),
                             ("ideal, torch on 1 core", "torch_ideal_samples_per_s", ":")):
        ax1.axhline(statistics.median(c[key] for c in cals), color="black", ls=style, lw=1, label=name)
    ax1.set_xticks(range(len(names)))
    ax1.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax1.set_ylabel("training samples/s (bars: steady window)")
    ax1.legend(fontsize=7)
    ax1.set_title("SD pipeline, trainer on core 0 (+ CPU node on core 1 for Ray); labels: x torch's better",
                  fontsize=8)
    st = [100 * s[c]["stall_fraction"]["median"] for c in names]
    ax2.bar(range(len(names)), st, color=colors)
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax2.set_ylabel("stall fraction % (waiting in next())")
    return h.save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, fewer steps (about 3 minutes)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    p.add_argument("--skip", type=int, default=None, help="warm-up steps left out (default 20; quick 15)")
    p.add_argument("--images", type=int, default=None,
                   help="rows of the generated dataset = one epoch, the length of every run (default 4096; quick 2048)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="no make-up runs start after this many seconds (default 780; quick 200)")
    p.add_argument("--trainer-cores", default="0", help="taskset list of the trainer and the head")
    p.add_argument("--node-core", default="1", help="the extra node's core")
    p.add_argument("--node-cpus", type=int, default=2, help="logical CPUs the extra node advertises")
    p.add_argument("--raydata-block-kib", type=int, default=256, help="Ray Data's target_max_block_size, KiB")
    p.add_argument("--max-outside", type=float, default=0.10,
                   help="a run where other processes took more of a pinned core gets one make-up run")
    p.add_argument("--no-makeup", dest="makeup", action="store_false", help="no make-up runs")
    p.add_argument("--only", default=None, help="comma-separated contenders to run (development)")
    p.add_argument("--target", type=float, default=1.3, help="the issue's target ratio sbloader / torch")
    p.add_argument("--quiet-timeout", type=float, default=None,
                   help="wait for a quiet machine, s (default 10; quick 3)")
    p.add_argument("--job-timeout", type=float, default=600.0, help="per job, s (a hung pipeline is stopped)")
    p.add_argument("--data", default=os.environ.get("SBLOADER_BENCH_DATA", "/tmp/sbloader_bench_sd"))
    p.add_argument("--out", default=NAME)
    p.add_argument("--format", choices=["parquet", "webdataset"], default="parquet",
                   help="what the Ray contenders read: the Parquet file, or the same rows as img2dataset-style "
                        "WebDataset shards (read_webdataset / ray.data.read_webdataset); torch reads the Parquet")
    p.add_argument("--samples-per-shard", type=int, default=256, help="samples per shard (--format webdataset)")
    p.add_argument("--from-json", default=None, help="re-render the report from a results JSON (no runs)")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        signal.signal(signal.SIGTERM, _on_term)
        job_main(args.job, json.loads(Path(args.job_config).read_text()), args.job_out)
        return
    if args.from_json:  # re-render the report of an earlier run (same command, machine and date)
        old = json.loads(Path(args.from_json).read_text())
        render(argparse.Namespace(**old["args"]), old["config"], old["rounds"], old["calibration"], old["jobs"],
               {k: old[k] for k in ("command", "machine", "git", "total_wall_s", "failures") if k in old})
        return
    if args.format == "webdataset" and args.out == NAME:
        args.out = f"{NAME}_webdataset"
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.images = args.images or (2048 if args.quick else 4096)
    args.steps = args.images // 8  # one epoch
    args.skip = args.skip if args.skip is not None else (15 if args.quick else 20)
    args.quiet_timeout = args.quiet_timeout if args.quiet_timeout is not None else (3.0 if args.quick else 10.0)
    args.time_budget = args.time_budget or (200.0 if args.quick else 780.0)
    if args.images % 8 or args.steps < args.skip + 20:
        p.error(f"--images must be a multiple of 8 and give more than {args.skip + 20} steps, found {args.images}")
    avail = os.sched_getaffinity(0)
    trainer = {int(c) for c in args.trainer_cores.split(",")}
    if int(args.node_core) not in avail or int(args.node_core) in trainer:
        p.error(f"--node-core {args.node_core} must be a core of this process ({sorted(avail)}) not in the trainer's")
    machine = h.machine_info()
    machine["versions"]["ray[data]"] = machine["versions"].get("ray")
    git_state = _gitstate.git_state()
    t_begin = time.monotonic()
    ckpt = tempfile.mkdtemp(prefix="bench_sd_ckpt_")
    base = {"images": args.images, "size": 64, "rows_per_group": 16, "batch_size": 8, "encode_batch": 16,
            "steps": args.steps, "skip": args.skip, "data": args.data, "ckpt_dir": ckpt, "store_mib": 512,
            "node_cores": [args.node_core], "node_cpus": args.node_cpus, "head_cpus": 1, "pss_interval_s": 0.5,
            "raydata_block_kib": args.raydata_block_kib, "format": args.format,
            "samples_per_shard": args.samples_per_shard}
    # Write the data once, before any job (the jobs only read it).
    from sd.data import dataset_path, write_dataset

    for a in {sd_args(base).format: sd_args(base), "parquet": sd_args(base, "torch")}.values():
        t = time.perf_counter()
        write_dataset(dataset_path(a), a)
        print(f"data: {dataset_path(a)} ({time.perf_counter() - t:.1f}s)", flush=True)
    jobs_spec = [("torch", {"order": list(TORCH)}),
                 ("cluster", {"order": list(CLUSTER), "extra_nodes": 1, "head_cpus": 1}),
                 ("cluster", {"order": ["sbloader_1node"], "extra_nodes": 0, "head_cpus": 2})]
    if args.only:
        keep = set(args.only.split(","))
        jobs_spec = [(j, {**e, "order": [c for c in e["order"] if c in keep]}) for j, e in jobs_spec]
        jobs_spec = [(j, e) for j, e in jobs_spec if e["order"] or j == "torch"]
    rounds: list[dict] = []
    cals: list[dict] = []
    jobs: list[dict] = []
    failures: list[dict] = []
    try:
        for rnd in range(args.rounds):
            figs: dict[str, Any] = {}
            print(f"round {rnd}", flush=True)
            for job, extra in rotate(jobs_spec, rnd):
                cfg = {**base, **extra, "order": rotate(extra["order"], rnd)}
                busy = h.wait_quiet(timeout_s=args.quiet_timeout)
                print(f"  job {job} ({', '.join(cfg['order'])}), machine busy {100 * busy:.0f}% before", flush=True)
                try:
                    res = run_job(job, cfg, args)
                except RuntimeError as e:  # reported; the round goes on without these contenders
                    print(f"  job {job} FAILED: {str(e)[-1500:]}", flush=True)
                    failures.append({"round": rnd, "job": job, "order": cfg["order"], "error": str(e)[-4000:]})
                    continue
                res.update(round=rnd, busy_before=busy)
                got = res.pop("contenders")
                bad = [c for c, f in got.items() if outside(f) > args.max_outside]
                late = time.monotonic() - t_begin > args.time_budget
                if bad and late:
                    print(f"  no make-up for {', '.join(bad)}: past --time-budget {args.time_budget:.0f}s", flush=True)
                if bad and args.makeup and not late:  # one make-up run of the disturbed ones; the quieter is kept
                    print(f"  make-up for {', '.join(bad)} (other processes took "
                          f"{', '.join(f'{100 * outside(got[c]):.0f}%' for c in bad)} of a core)", flush=True)
                    h.wait_quiet(timeout_s=args.quiet_timeout)
                    try:
                        again = run_job(job, {**cfg, "order": bad}, args)
                    except RuntimeError as e:  # the disturbed runs stand
                        print(f"  make-up FAILED: {str(e)[-1500:]}", flush=True)
                        failures.append({"round": rnd, "job": job, "order": bad, "makeup": True,
                                         "error": str(e)[-4000:]})
                        again = {"contenders": {}, "failed": True}
                    again.update(round=rnd, makeup=True)
                    for c, f in again.pop("contenders").items():
                        f["makeup_of_outside"] = outside(got[c])
                        if outside(f) < outside(got[c]):
                            got[c] = f
                    if "calibration" in again:
                        cals.append(again["calibration"])
                    if not again.get("failed"):
                        jobs.append(again)
                figs.update(got)
                if "calibration" in res:
                    cals.append(res["calibration"])
                jobs.append(res)
            rounds.append(figs)
    finally:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    if not cals or not any(rounds):
        raise SystemExit(f"no results: {len(failures)} job(s) failed" + (f"; last: {failures[-1]['error'][-2000:]}"
                                                                          if failures else ""))
    meta = {"command": command_line(), "machine": machine, "git": git_state,
            "total_wall_s": time.monotonic() - t_begin, "failures": failures}
    raw = Path(tempfile.gettempdir()) / f"bench_{args.out}_raw.json"  # re-render with --from-json if the report fails
    raw.write_text(json.dumps({"args": vars(args), "config": base, "rounds": rounds, "calibration": cals,
                               "jobs": jobs, **meta}, default=str))
    render(args, base, rounds, cals, jobs, meta)


def command_line() -> str:
    """This command, with the ``flock <lock>`` it runs under when an ancestor process is one."""
    pid = os.getpid()
    for _ in range(4):
        st = h._read_stat(pid)
        if st is None:
            break
        pid = st[0]
        words = h.cmdline(pid).split()
        if words and os.path.basename(words[0]) == "flock" and len(words) > 1:
            return f"flock {words[1]} {h.command_line()}"
    return h.command_line()


def render(args: argparse.Namespace, base: dict, rounds: list, cals: list, jobs: list, meta: dict) -> None:
    """Write the JSON, the Markdown and the plot."""
    payload, md = report(args, base, rounds, cals, jobs)
    payload.update(meta)
    if meta.get("failures"):
        md += "\n\n## Failed jobs\n\n" + "\n".join(
            f"- round {f['round']}, {'make-up of ' if f.get('makeup') else ''}job {f['job']} "
            f"({', '.join(f['order'])}): `{f['error'].strip().splitlines()[-1][:300]}`" for f in meta["failures"])
    png = plot(payload["summary"], cals, h.RESULTS_DIR / f"{args.out}.png", args.target)
    h.publish(args.out, payload, md, title="SD pipeline: throughput and stall fraction (torch, Ray Data, sbloader)",
              png=png, alt="sd", note=f" in {payload['total_wall_s']:.0f}s")


if __name__ == "__main__":
    main()
