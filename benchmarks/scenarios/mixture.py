"""The cost of mixing (#49): the crop workload (JPEG, window decode, random-resized-crop 224, flip,
CHW, batches of 64) split into 3 sources of 60/25/15% of the images, read through ``sbloader.mix``
at weights 0.6/0.25/0.15 against the largest source alone (target: within 3% of its images/s); a
run is one epoch: every source's once for the mixture (``on_exhausted="drop"``), the source's for
it alone; and a mixture whose second source is a handful of images that restarts several times a run
(``on_exhausted="restart"``, the default), ``num_samples`` the largest source's size. Beside them the same sources, weights and crop through litdata's
``CombinedStreamingDataset`` and torchdata's ``MultiNodeWeightedSampler`` (where installed).
Images/s and CPU ms per image of the process tree, one warm-up epoch each, then interleaved rounds."""
from __future__ import annotations

import gc
import tempfile
import time
from typing import Any

from benchmarks.harness import Outcome, Plan, run_interleaved
from benchmarks.harness.rounds import median

from ._common import epoch_contenders, jpeg_paths, missing_peers, start_peers

ORDER = 75
TITLE = "Data mixtures: sbloader.mix of 3 sources vs the largest alone, litdata, torchdata"
PARAMS = {"images": 2048, "cores": 2, "rounds": 5, "torchdata_method": "thread"}
QUICK = {"images": 384, "rounds": 3}
WEIGHTS = {"large": 0.6, "medium": 0.25, "small": 0.15}  # each source's weight and share of the images
MIX, ALONE = "sbloader mix (3 sources)", "sbloader, largest source alone"
RESTART, WHOLE = "sbloader mix, a tiny source restarting", "sbloader mix, the small source (no restart)"
TINY = {"images": 24, "weight": 0.15}  # the restarting source: 64 * 0.15 of its images a batch, 2-3 batches an epoch
ORDERED = "sbloader, largest source alone, deterministic=True"
LIT, TD = "litdata CombinedStreamingDataset", "torchdata MultiNodeWeightedSampler"
PEERS = {LIT: "litdata", TD: "torchdata.nodes"}


def split(paths: list[str]) -> dict[str, list[str]]:
    """The images in listing order, cut into the sources by their shares."""
    out, start = {}, 0
    for i, (name, share) in enumerate(WEIGHTS.items()):
        end = len(paths) if i == len(WEIGHTS) - 1 else start + round(share * len(paths))
        out[name], start = paths[start:end], end
    return out


def plan(**p: Any) -> Plan:
    """The mixture, the largest source alone (as a user reads it, and in a fixed order as the
    mixture reads its sources), and the peers that are installed."""
    skipped = missing_peers(PEERS)
    return Plan([MIX, RESTART, WHOLE, ALONE, ORDERED] + [k for k in PEERS if k not in skipped], p["rounds"], skipped,
                f"{p['images']} JPEGs in 3 sources (60/25/15%), one epoch per run")


def cpus_back(within_s: float = 10.0) -> None:
    """Wait until Ray's CPUs are all free again: a closed loader's running tasks finish (close() does not
    cancel them), and their CPU would otherwise be counted in the next contender's run."""
    import ray

    total, deadline = ray.cluster_resources().get("CPU", 0), time.monotonic() + within_s
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.01)


def run(**p: Any) -> Outcome:
    """Every loader built and warmed up once, then ``rounds`` interleaved epochs."""
    import torch

    import sbloader
    from benchmarks import _image_workload as w

    from . import _peers

    paths = jpeg_paths(p["images"])
    for f in paths:  # the page cache
        open(f, "rb").read()
    parts = split(paths)
    cores = p["cores"]
    sbloader.init(num_cpus=cores)

    def source(ps: list[str]) -> Any:
        return sbloader.read_images(ps, decode=False).map_batches(w.sbl_decode_files_window_batch)

    mixed = sbloader.mix({k: source(v) for k, v in parts.items()}, weights=WEIGHTS, seed=0,
                         on_exhausted="drop").to_dataloader(w.BATCH, shuffle=True)
    def second(images: list) -> Any:  # the largest source and another at TINY's weight, len(large) samples a run
        m = sbloader.mix({"large": source(parts["large"]), "tiny": source(images)},
                         weights={"large": 1 - TINY["weight"], "tiny": TINY["weight"]}, seed=0)
        return m.to_dataloader(w.BATCH, shuffle=True, num_samples=len(parts["large"]))

    def closed_after(loader: Any) -> Any:  # nothing made between runs (close() stops the sources, as they were)
        yield from loader
        loader.close()
        cpus_back()  # the tasks close() lets finish run in this contender's time, not the next one's

    restarting, whole = second(parts["small"][:TINY["images"]]), second(parts["small"])

    alone = source(parts["large"]).to_dataloader(w.BATCH, shuffle=True, seed=0)
    ordered = source(parts["large"]).to_dataloader(w.BATCH, shuffle=True, seed=0, deterministic=True)
    epochs = {MIX: lambda: iter(mixed), RESTART: lambda: closed_after(restarting),
              WHOLE: lambda: closed_after(whole), ALONE: lambda: iter(alone),
              ORDERED: lambda: iter(ordered)}
    skipped = missing_peers(PEERS)
    with tempfile.TemporaryDirectory(prefix="sbloader_bench_litdata_") as tmp:
        epochs.update(start_peers({LIT: lambda: _peers.litdata_mix_epochs(parts, WEIGHTS, cores, tmp),
                                   TD: lambda: _peers.torchdata_mix_epochs(parts, WEIGHTS, cores,
                                                                           p["torchdata_method"])}, skipped))
        torch.set_num_threads(1)
        trials = run_interleaved(epoch_contenders(epochs, skipped), p["rounds"])
        stats, restarts = mixed.stats(), restarting.stats().sources["tiny"].epoch
        mixed.close()
        del epochs, alone, ordered, restarting, whole
        gc.collect()  # litdata's and torchdata's workers end before their files go
    for t in trials.trials:
        if t.metrics.get("images"):
            t.metrics["cpu_ms_per_image"] = 1e3 * t.metrics["cpu_s"] / t.metrics["images"]
    def ratio(a: str, b: str) -> str:  # the medians' ratio of two contenders' images/s
        med = {n: median(t.metrics.get("images_per_s") for t in trials.trials if t.contender == n) for n in (a, b)}
        return f"{med[a] / med[b]:.2f}x" if med[a] and med[b] else "not measured"

    shares = ", ".join(f"{k} {s.share:.3f}" for k, s in stats.sources.items())
    return Outcome(trials, "images_per_s", "images/s", baseline=ALONE, skipped=skipped,
                   extra=("images", "cpu_ms_per_image", "first_batch_s"),
                   raw={"sources": {k: len(v) for k, v in parts.items()}},
                   notes=[f"Target (#49): `{MIX}` within 3% of `{ALONE}` (its ratio >= 0.97) on a quiet machine.",
                          f"Sources {', '.join(f'{k} {len(v)}' for k, v in parts.items())} images, weights "
                          f"{', '.join(f'{k} {v}' for k, v in WEIGHTS.items())}; the mixture's shares over all its "
                          f"epochs: {shares}.",
                          f"`{RESTART}`: the largest source and {TINY['images']} images of the small one at "
                          f"weight {TINY['weight']} (on_exhausted='restart'; its tiny source began {restarts + 1} "
                          f"epochs over the warm-up and rounds); `{WHOLE}` the same with all the small source's "
                          "images, which last a run. Both read the largest source's count of samples a run and are "
                          "closed after it (the batches made ahead are dropped: no work between runs), so their "
                          f"ratio is the cost of the restarts: {ratio(RESTART, WHOLE)}.",
                          "A run is one whole epoch (images: per run), not a fixed count cut from a stream: a "
                          "mixture read on across runs (on_exhausted='restart', num_samples) prefetches its sources "
                          "while the others run, and a quick run found most of its next run made before it began.",
                          "mix() runs every source deterministic=True (a fixed delivery order); "
                          f"`{ORDERED}` tells that cost from the mixing's.",
                          "litdata: each source written once by litdata.optimize before the timed runs, "
                          "StreamingDataset(shuffle=True, transform=crop), CombinedStreamingDataset(weights, "
                          f"iterate_over_all=False: its epoch ends when a worker's share of a source runs out), "
                          f"StreamingDataLoader({cores} persistent workers). torchdata: a node per source, "
                          "MultiNodeWeightedSampler(ALL_DATASETS_EXHAUSTED), ParallelMapper("
                          f"{cores} workers, method={p['torchdata_method']!r}), Batcher, Loader.",
                          "All decode only the crop window (sbloader.transforms.decode_crop_flip); CPU ms per "
                          "image: this process and all its descendants (workers, Ray, threads)."])
