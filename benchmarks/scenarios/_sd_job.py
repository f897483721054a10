"""The trainer of ``sd_pipeline.py`` (the SD workload, one module): one run of
``trainers/sd``'s training loop (``sd.loop.train``) over one source of encoded batches,
pinned to ``cores`` (the emulated trainer node), printing one JSON line of figures.

    python -m benchmarks.scenarios._sd_job '{"contender": "torch", "cores": [0], ...}'

Contenders (``contender``):

- ``torch``: train_sd's ``--loader torch`` (torch's DataLoader decoding in ``workers``
  processes, the encoders in the trainer), no Ray.
- ``sbloader``: train_sd's ``--loader sbloader`` pipeline (read_parquet -> preprocess tasks
  -> SDEncoders actor pool -> to_dataloader) on the cluster at ``RAY_ADDRESS``.
- ``Ray Data``: the same stages as Ray Data (read_parquet -> map_batches(preprocess) ->
  map_batches(SDEncoders, ActorPoolStrategy(size=1)) -> iter_torch_batches) on that cluster.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TRAINERS = Path(__file__).resolve().parents[2] / "trainers"


def sd_args(cfg: dict, loader: str) -> Any:
    """train_sd's options for one run (one epoch of the generated rows, no checkpoint)."""
    from sd.cli import parse_args

    steps = cfg["images"] // cfg["batch_size"]
    return parse_args([
        "--loader", loader, "--workers", str(cfg["workers"]), "--images", str(cfg["images"]),
        "--size", str(cfg["size"]), "--rows-per-group", str(cfg["rows_per_group"]),
        "--batch-size", str(cfg["batch_size"]), "--encode-batch", str(cfg["encode_batch"]),
        "--encoder-actors", "1", "--steps", str(steps), "--ckpt-every", str(steps + 1), "--keep-ckpts", "1",
        "--ckpt-dir", os.path.join(cfg["data"], "ckpt"), "--data", cfg["data"], "--seed", "0"])


def _raydata_preprocess(batch: dict, **kwargs: Any) -> dict:
    """train_sd's ``preprocess`` under Ray Data: it draws from sbloader's task context, so give it one."""
    from sd.data import preprocess

    from sbloader.core.context import task_context

    with task_context(0, 0, int(batch["id"][0]), "preprocess", 0):
        return preprocess(batch, **kwargs)


def raydata_source(args: Any, path: str, block_kib: int) -> Any:
    """Ray Data's version of the pipeline behind train_sd's ``BatchSource`` interface. Its
    target block size is ``block_kib`` (at the default 128 MiB the file is one block and the
    first batch would wait for every row's encoding)."""
    import logging

    import ray.data
    from sd.encoders import SDEncoders
    from sd.sources import BatchSource

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.target_max_block_size = block_kib * 1024
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    class RayDataSource(BatchSource):
        kind = "raydata"

        def __init__(self) -> None:
            kw = dict(size=args.size, max_tokens=args.max_tokens, vocab=args.vocab)
            self.dataset = (
                ray.data.read_parquet(path, columns=["id", "image", "caption"])
                .map_batches(_raydata_preprocess, batch_size=args.rows_per_group, num_cpus=1,
                             batch_format="numpy", fn_kwargs=kw)
                .map_batches(SDEncoders, batch_size=args.encode_batch, batch_format="numpy",
                             compute=ray.data.ActorPoolStrategy(size=1), num_cpus=args.encoder_cpus,
                             fn_constructor_kwargs=dict(vocab=args.vocab, max_tokens=args.max_tokens,
                                                        text_dim=args.text_dim, seed=args.encoder_seed)))

        def batches(self) -> Any:
            while True:
                yield from self.dataset.iter_torch_batches(batch_size=args.batch_size, drop_last=True)
                self.epoch += 1

        def state_dict(self) -> dict:
            return {"kind": self.kind, "epoch": self.epoch}

    return RayDataSource()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if hasattr(os, "sched_setaffinity") and cfg.get("cores"):
        os.sched_setaffinity(0, set(cfg["cores"]))  # the emulated trainer node (its workers inherit it)
    sys.path.insert(0, str(TRAINERS))
    import torch
    from sd.data import dataset_path
    from sd.loop import train

    torch.set_num_threads(len(cfg.get("cores") or [0]))
    name = cfg["contender"]
    args = sd_args(cfg, "torch" if name == "torch" else "sbloader")
    device = torch.device("cpu")
    source = None
    if name == "Ray Data":
        import sbloader

        sbloader.init(address=os.environ["RAY_ADDRESS"])  # joins as a user's driver would (token, loopback)
        source = raydata_source(args, dataset_path(args), cfg["raydata_block_kib"])
    r = train(args, 0, 1, device, source=source)
    print(json.dumps({k: r[k] for k in ("samples_per_s", "steady_samples_per_s", "stall_fraction",
                                        "first_batch_s", "steps_run", "wall_s", "wait_s")}), flush=True)


if __name__ == "__main__":
    main()
