"""Images from a bucket at 0, 20 and 100 ms per request (a lean S3-compatible server on
127.0.0.1, ``benchmarks/_lean_s3.py``, one port per latency) against the same files on
local disk: sbloader's ``read_images("s3://...", filesystem=S3FileSystem(...))`` as a user
first writes it (no cache), and torch's DataLoader over a Dataset that gets each
object with boto3 (2 workers). One epoch per run, the iterator's start-up included;
the decode is sbloader's window crop for every contender."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

from benchmarks.harness import BENCH_DIR, Outcome, Plan, paired_ratios, run_interleaved

from ._common import DATA, batch_len, jpeg_paths, missing_peers, time_epoch

ORDER = 50
TITLE = "A bucket at 0/20/100 ms per request vs local disk"
PARAMS = {"images": 256, "latencies_ms": [0, 20, 100], "num_workers": 2, "rounds": 3}
QUICK = {"images": 96, "rounds": 3}
BUCKET = "bench"


def _names(p: dict) -> list[str]:
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    return ["sbloader local", "torch local"] + [f"{c} {ms} ms" for ms in lats for c in ("sbloader s3", "torch+boto3")]


def plan(**p: Any) -> Plan:
    """Local and per-latency contenders of sbloader and torch (+boto3)."""
    skipped = missing_peers({"torch+boto3": "boto3"})
    return Plan([n for n in _names(p) if not any(n.startswith(s) for s in skipped)], p["rounds"], skipped,
                f"{p['images']} JPEGs per epoch")


class Boto3Images:
    """A map-style Dataset reading each object with boto3 (one client per worker), as users write one."""

    def __init__(self, endpoint: str, keys: list[str]) -> None:
        self.endpoint, self.keys, self._client = endpoint, keys, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Any:
        import torch

        from benchmarks import _image_workload as w

        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="x",
                                        aws_secret_access_key="x", region_name="us-east-1")
        data = self._client.get_object(Bucket=BUCKET, Key=self.keys[i])["Body"].read()
        return torch.from_numpy(w.T.decode_crop_flip(data, w.SIZE, w.process_rng())), w.label_of(self.keys[i])


def run(**p: Any) -> Outcome:
    """Start the lean server (a child of this process: its CPU counts as ours), then interleave."""
    import pyarrow.fs as pafs
    import torch

    import sbloader
    from benchmarks import _image_workload as w

    paths = jpeg_paths(p["images"])
    root = DATA / "jpeg"
    keys = [str(__import__("os").path.relpath(x, root)) for x in paths]
    lats = [f"{float(x):g}" for x in p["latencies_ms"]]
    srv = subprocess.Popen([sys.executable, str(BENCH_DIR / "_lean_s3.py"), str(root), BUCKET] + lats,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    eps = json.loads(srv.stdout.readline())
    sbloader.init(num_cpus=2)
    kw = {"batch_size": w.BATCH, "shuffle": True, "num_workers": p["num_workers"]}

    def sbl(src: Any, fs: Any = None):
        def go() -> dict:
            loader = (sbloader.read_images(src, decode=False, **({"filesystem": fs} if fs else {}))
                      .map_batches(w.sbl_decode_files_window_batch).to_dataloader(w.BATCH, shuffle=True))
            r = time_epoch(lambda: iter(loader), batch_len)
            del loader
            gc.collect()
            return {"images_per_s": r["items"] / r["epoch_s"], "first_batch_s": r["first_batch_s"]}
        return go

    def tl(ds: Any):
        def go() -> dict:
            r = time_epoch(lambda: iter(torch.utils.data.DataLoader(ds, **kw)), batch_len)
            return {"images_per_s": r["items"] / r["epoch_s"], "first_batch_s": r["first_batch_s"]}
        return go

    contenders = {"sbloader local": sbl(paths), "torch local": tl(w.ImageFolderDataset(paths))}
    skipped = missing_peers({"torch+boto3": "boto3"})
    for ms in lats:
        fs = pafs.S3FileSystem(endpoint_override=eps[ms], access_key="x", secret_key="x", region="us-east-1",
                               scheme="http")
        contenders[f"sbloader s3 {ms} ms"] = sbl([f"s3://{BUCKET}/{k}" for k in keys], fs)
        if not skipped:
            contenders[f"torch+boto3 {ms} ms"] = tl(Boto3Images(eps[ms], keys))
    try:
        sbl(paths)()  # warm-up: Ray's workers, imports, the page cache
        trials = run_interleaved(contenders, p["rounds"])
    finally:
        srv.stdin.close()
        srv.wait(30)
    notes = []
    for ms in lats:
        for other in ("sbloader local", f"torch+boto3 {ms} ms"):
            rs = sorted(paired_ratios(trials, "images_per_s", f"sbloader s3 {ms} ms", other))
            if rs:
                notes.append(f"sbloader s3 {ms} ms / {other}: median {rs[len(rs) // 2]:.2f}x "
                             f"(min {rs[0]:.2f}, max {rs[-1]:.2f}), paired per round")
    notes.append("the server runs on the same cores (a child of the benchmark: its CPU counts as the run's own)")
    return Outcome(trials, "images_per_s", "images/s", baseline="sbloader local", extra=("first_batch_s",),
                   skipped=skipped, notes=notes)
