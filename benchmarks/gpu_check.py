"""Absolute figures on a lent GPU, the device named (run by ``benchmarks/gpu_check.sh``):

1. ``pin``: host->device copies of uint8 batches (64x3x224x224) from pageable and from
   pinned memory, ``non_blocking=True`` on a side stream, GB/s; and the drop-in
   ``sbloader.DataLoader(pin_memory=True)`` feeding ``.to(dev, non_blocking=True)``.
2. ``gpu_stage``: a pipeline stage on the GPU: ``range(n).map_batches(GpuMatmul,
   num_gpus=0.5, concurrency=1)`` (an actor holding a CUDA matrix), rows/s and the
   device the actor saw.
3. ``sd``: ``trainers/train_sd.py`` (its UNet on the GPU) with sbloader and with torch's
   DataLoader: steps/s, samples/s and the stall fraction from its metrics.
4. ``crop``: the crop workload's batches on the GPU: sbloader
   ``to_dataloader(64, pin_memory=True, device="cuda")`` and torch's DataLoader
   (``pin_memory=True``, 2 workers) + ``.to(dev, non_blocking=True)``; images/s.

    python -m benchmarks.gpu_check [--dry-run] [--out DIR]

``--dry-run`` runs every step at a tiny size on whatever device there is (the CPU here),
so the plan is exercised where no GPU is lent. Writes ``gpu_check.json`` and ``.md``
under ``benchmarks/results/`` (and ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import ROOT, command_line, machine_info, markdown_table, ray_worker_env, write_results


def device_name() -> tuple[Any, str]:
    """The torch device and its name in words."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return torch.device("cpu"), "CPU (no CUDA device: a dry run)"


def step_pin(dev: Any, small: bool) -> dict:
    """Host->device copy bandwidth, pageable vs pinned, and the drop-in with pin_memory."""
    import torch

    import sbloader

    cuda = dev.type == "cuda"
    x = torch.randint(0, 255, (64, 3, 224, 224), dtype=torch.uint8)
    reps = 4 if small else 50
    out: dict = {}
    for name, src in (("pageable", x), ("pinned", x.pin_memory() if cuda else x)):
        stream = torch.cuda.Stream() if cuda else None
        t0 = time.perf_counter()
        for _ in range(reps):
            if cuda:
                with torch.cuda.stream(stream):
                    src.to(dev, non_blocking=True)
            else:
                src.clone()
        if cuda:
            torch.cuda.synchronize()
        out[f"{name}_GBps"] = reps * x.numel() / (time.perf_counter() - t0) / 1e9
    ds = torch.utils.data.TensorDataset(torch.randint(0, 255, (256 if small else 1024, 3, 224, 224), dtype=torch.uint8))
    loader = sbloader.DataLoader(ds, batch_size=64, num_workers=2, pin_memory=cuda)
    t0, n = time.perf_counter(), 0
    for (b,) in loader:
        n += len(b.to(dev, non_blocking=True))
    if cuda:
        torch.cuda.synchronize()
    out["dropin_pinned_images_per_s"] = n / (time.perf_counter() - t0)
    return out


class GpuMatmul:
    """An actor stage holding a matrix on the GPU: each batch's rows times it."""

    def __init__(self) -> None:
        import torch

        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.w = torch.randn(512, 512, device=self.dev)

    def __call__(self, batch: dict) -> dict:
        import numpy as np
        import torch

        x = torch.as_tensor(np.asarray(batch["id"], dtype=np.float32), device=self.dev)
        y = (x[:, None].expand(-1, 512) @ self.w).sum(1)
        return {"id": batch["id"], "y": y.cpu().numpy(), "device": np.array([str(self.dev)] * len(x))}


def step_gpu_stage(dev: Any, small: bool) -> dict:
    """A GPU actor stage in a pipeline: rows/s and the device the actor used."""
    import sbloader

    n = 2048 if small else 200_000
    gpus = 0.5 if dev.type == "cuda" else None
    ds = sbloader.range(n).map_batches(GpuMatmul, num_gpus=gpus, concurrency=1, batch_size=1024)
    t0, rows, devices = time.perf_counter(), 0, set()
    for b in ds.to_dataloader(1024):
        rows += len(b["id"])
        devices.update(str(d) for d in b["device"])
    return {"rows_per_s": rows / (time.perf_counter() - t0), "rows": rows, "actor_device": sorted(devices)}


def step_sd(dev: Any, small: bool) -> dict:
    """The SD trainer (UNet on the GPU when there is one), sbloader vs torch's DataLoader."""
    out = {}
    for loader in ("sbloader", "torch"):
        with tempfile.TemporaryDirectory() as d:
            args = ["--images", "32" if small else "256", "--steps", "2" if small else "40", "--batch-size",
                    "4" if small else "16", "--metrics-dir", d, "--ckpt-dir", os.path.join(d, "ckpt"),
                    "--data", os.path.join(d, "data"), "--loader", loader]
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, str(ROOT / "trainers" / "train_sd.py"), *args], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"train_sd.py --loader {loader}: {r.stderr[-800:]}")
            m = json.loads(Path(d, "rank0.json").read_text())
            out[loader] = {**{k: m.get(k) for k in (
                "device", "steps_run", "samples", "wall_s", "first_batch_s", "samples_per_s", "steady_samples_per_s",
                "stall_fraction") if k in m}, "process_s": time.perf_counter() - t0}
    return out


def step_crop(dev: Any, small: bool) -> dict:
    """The crop workload with its batches on the device: sbloader and torch."""
    import torch

    import sbloader
    from benchmarks import _image_workload as w
    from benchmarks.scenarios._common import jpeg_paths

    cuda = dev.type == "cuda"
    paths = jpeg_paths(128 if small else 2048)
    sbl = (sbloader.read_images(paths, decode=False).map_batches(w.sbl_decode_files_window_batch)
           .to_dataloader(64, shuffle=True, pin_memory=cuda, device=dev if cuda else None))
    tl = torch.utils.data.DataLoader(w.ImageFolderDataset(paths), batch_size=64, shuffle=True, num_workers=2,
                                     pin_memory=cuda, persistent_workers=True)

    def epoch(it: Callable[[], Any], get: Callable[[Any], Any]) -> float:
        t0, n = time.perf_counter(), 0
        for b in it():
            x = get(b).to(dev, non_blocking=True)
            n += len(x)
        if cuda:
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)

    out: dict = {"sbloader": [], "torch": []}
    for _ in range(1 if small else 3):  # interleaved epochs (the first one warms up both)
        out["sbloader"].append(epoch(lambda: iter(sbl), lambda b: b["image"]))
        out["torch"].append(epoch(lambda: iter(tl), lambda b: b[0]))
    return {k + "_images_per_s": v for k, v in out.items()}


STEPS = {"pin": step_pin, "gpu_stage": step_gpu_stage, "crop": step_crop, "sd": step_sd}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on whatever device there is")
    ap.add_argument("--out", default=None, help="also copy the results here")
    ap.add_argument("--only", default=None, help="comma-separated steps")
    a = ap.parse_args()
    ray_worker_env()
    dev, name = device_name()
    print(f"device: {name}", flush=True)
    import sbloader

    sbloader.init(num_cpus=max(2, (os.cpu_count() or 2) - 2))  # two cores left to the trainer
    results: dict = {"device": name, "dry_run": a.dry_run, "steps": {}}
    results.update(command=command_line(), machine=machine_info())
    md = "no step run"
    for step, fn in STEPS.items():
        if a.only and step not in a.only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            results["steps"][step] = {"ok": True, **fn(dev, a.dry_run)}
        except Exception as e:  # noqa: BLE001 - one step's failure is reported, the others run
            traceback.print_exc()
            results["steps"][step] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-500:]}"}
        results["steps"][step]["step_s"] = round(time.perf_counter() - t0, 1)
        print(f"{step}: {json.dumps(results['steps'][step], default=str)}", flush=True)
        md = publish(results, name, a)  # after every step: a run cut short keeps what it measured
    print(md)
    return 0 if all(v["ok"] for v in results["steps"].values()) else 1


def publish(results: dict, name: str, a: argparse.Namespace) -> str:
    """Write ``gpu_check[_dry_run].{json,md}`` under benchmarks/results/ (and ``--out``); the Markdown."""
    rows = [{"step": k, "result": ", ".join(f"{kk}={_short(vv)}" for kk, vv in v.items())} for k, v in
            results["steps"].items()]
    md = (f"Device: **{name}**. Absolute figures (one machine, one run); "
          + ("a DRY RUN at tiny sizes: not figures. " if a.dry_run else "") + "\n\n" + markdown_table(rows))
    jpath, mpath = write_results("gpu_check_dry_run" if a.dry_run else "gpu_check", results, md,
                                 title=f"GPU check on {name}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        for p in (jpath, mpath):
            (Path(a.out) / p.name).write_text(p.read_text())
    return mpath.read_text()


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and v and isinstance(v[0], float):
        return "[" + ", ".join(f"{x:.4g}" for x in v) + "]"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
