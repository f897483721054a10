"""The crop workload (read a JPEG, random-resized-crop 224, random flip, uint8 CHW,
batches of 64, 2 workers/threads on 2 cores) through sbloader and its native peers, a
new epoch per run after one warm-up epoch each: sbloader's pipeline, torch's DataLoader
(``persistent_workers=True``) with Pillow's whole decode as a torch user writes it and
with sbloader's window decode, Ray Data, DALI CPU, SPDL and tf.data (the last four only
where installed). Images/s and CPU ms per image of the whole process tree."""
from __future__ import annotations

import gc
from typing import Any, Callable

from benchmarks.harness import Outcome, Plan, run_interleaved

from ._common import epoch_contenders, jpeg_paths, missing_peers, start_peers

ORDER = 30
TITLE = "The crop workload: sbloader vs torch, Ray Data, DALI CPU, SPDL, tf.data"
PARAMS = {"images": 2048, "cores": 2, "rounds": 3}
QUICK = {"images": 384, "rounds": 3}
PEERS = {"Ray Data": "ray.data", "DALI CPU": "nvidia.dali", "SPDL": "spdl.io", "tf.data": "tensorflow"}
BASE = ("sbloader", "torch (Pillow decode)", "torch (window decode)")


def plan(**p: Any) -> Plan:
    """sbloader and two torch loaders, and the peers that are installed."""
    skipped = missing_peers(PEERS)
    return Plan(list(BASE) + [k for k in PEERS if k not in skipped], p["rounds"], skipped,
                f"{p['images']} JPEGs, one epoch per run")


def build(paths: list[str], cores: int) -> tuple[dict[str, Callable[[], Any]], dict[str, str], list]:
    """Epoch factories of the contenders that start, the ones that did not with why, what to keep alive."""
    import torch

    import sbloader
    from benchmarks import _image_workload as w

    sbloader.init(num_cpus=cores)
    sbl = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_window_batch)
           .to_dataloader(w.BATCH, shuffle=True, seed=0))
    kw = {"batch_size": w.BATCH, "shuffle": True, "num_workers": cores, "persistent_workers": True}
    tp = torch.utils.data.DataLoader(w.ImageFolderDataset(paths, exact=True), **kw)
    tw = torch.utils.data.DataLoader(w.ImageFolderDataset(paths), **kw)
    out = {"sbloader": lambda: iter(sbl), "torch (Pillow decode)": lambda: iter(tp),
           "torch (window decode)": lambda: iter(tw)}
    skipped = missing_peers(PEERS)
    from . import _peers

    makers = {"Ray Data": _peers.ray_data_epochs, "DALI CPU": _peers.dali_epochs, "SPDL": _peers.spdl_epochs,
              "tf.data": _peers.tf_data_epochs}
    out.update(start_peers(makers, skipped, paths, cores))
    torch.set_num_threads(1)
    return out, skipped, [sbl, tp, tw]


def run(**p: Any) -> Outcome:
    """One warm-up epoch per contender, then ``rounds`` interleaved epochs."""
    paths = jpeg_paths(p["images"])
    for f in paths:  # the page cache
        open(f, "rb").read()
    epochs, skipped, keep = build(paths, p["cores"])
    trials = run_interleaved(epoch_contenders(epochs, skipped), p["rounds"])
    for t in trials.trials:
        t.metrics["cpu_ms_per_image"] = 1e3 * t.metrics["cpu_s"] / p["images"]
    del keep
    gc.collect()
    return Outcome(trials, "images_per_s", "images/s", baseline="torch (Pillow decode)",
                   extra=("cpu_ms_per_image", "first_batch_s"), skipped=skipped,
                   notes=["sbloader, torch (window decode) and Ray Data run sbloader.transforms.decode_crop_flip "
                          "(decodes only the crop window); torch (Pillow decode) decodes the whole JPEG, as a torch "
                          "user's Dataset does; DALI decodes the crop window too; SPDL decodes through FFmpeg with a "
                          "crop+scale filter; tf.data decodes the crop window (decode_and_crop_jpeg).",
                          "CPU ms per image: this process and all its descendants (workers, Ray, threads)."])
