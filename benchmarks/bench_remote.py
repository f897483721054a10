"""Superseded by the scenarios ``bucket_latency`` (first and cached epochs against local
disk, obstore and pyarrow clients, torch+boto3, a lean store whose CPU per request is
reported, requests in flight over time) and ``object_clients`` (the clients alone):
``python -m benchmarks run bucket_latency``. Kept for the moto-based figures of
``benchmarks/results/remote.md``.

Images from an S3-compatible store (moto on 127.0.0.1, behind proxies adding 0, 20 and
100 ms to every request): sbloader against torch's DataLoader and Ray Data, epoch 1
(cold) and epoch 2 (sbloader's node-local cache warm), in the same run.

The workload is ``bench_images``' (JPEG decode + random-resized-crop 224 + flip, batches
of 64), the consumer idle (throughput). Contenders, interleaved round by round:

- ``sbloader local``: ``read_images(folder, decode=False).map_batches(decode_crop_flip)
  .to_dataloader(64, shuffle=True)`` over the same files on local disk (the reference);
- ``sbloader s3 <ms>``: the same pipeline over ``s3://bucket/prefix`` with
  ``filesystem=pyarrow.fs.S3FileSystem(endpoint_override=<proxy>)``; a fresh cache
  directory every round, so epoch 1 is cold and epoch 2 reads the cache;
- ``torch s3 <ms>``: ``torch.utils.data.DataLoader(num_workers=2, batch_size=64,
  shuffle=True)`` over a map-style Dataset that gets each sample with boto3's
  ``get_object`` (one client per worker), as users write it;
- ``Ray Data s3 <ms>``: ``ray.data.read_images("s3://...", filesystem=<same>)
  .map_batches(crop_flip).iter_torch_batches(64)`` (it decodes in the read).

Each epoch is timed from the iterator's creation to its last batch (start-up
included). The proxies count object GETs: epoch 2 of sbloader should have none.

    python3 benchmarks/bench_remote.py --images 256 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import _harness as h

h.ray_worker_env()

import _image_workload as w  # noqa: E402

BUCKET = "sbloader-bench"
BATCH = w.BATCH


def _start_server(latencies: list[float]) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_s3_serve.py"))]
                            + [str(x) for x in latencies], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    return proc, info


def _object_gets(endpoint: str) -> int:
    with urllib.request.urlopen(endpoint + "/__sbloader_proxy_stats") as r:
        return int(json.loads(r.read())["object_gets"])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _upload(moto: str, root: str) -> int:
    import boto3
    from concurrent.futures import ThreadPoolExecutor

    c = boto3.client("s3", endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1")
    c.create_bucket(Bucket=BUCKET)
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: c.upload_file(p, BUCKET, "images/" + os.path.relpath(p, root)), files))
    return len(files)


class Boto3ImageDataset:
    """A map-style Dataset reading each sample with boto3, one client per worker process."""

    def __init__(self, endpoint: str, keys: list[str]) -> None:
        self.endpoint, self.keys, self._client = endpoint, keys, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                                        aws_secret_access_key="testing", region_name="us-east-1")
        key = self.keys[i]
        data = self._client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return torch.from_numpy(w.T.decode_crop_flip(data, w.SIZE, w.process_rng())), w.label_of(key)


def _s3fs(endpoint: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint, access_key="testing", secret_key="testing",
                             region="us-east-1", scheme="http")


def _epochs(make_iter: Callable[[], Any], images_of: Callable[[Any], Any], endpoint: Any, server_pid: int,
            n_epochs: int = 2) -> list[dict]:
    out = []
    for _ in range(n_epochs):
        load0 = os.getloadavg()[0]
        before = _object_gets(endpoint) if endpoint else 0
        cpu0 = _cpu_s(server_pid)
        t0 = time.perf_counter()
        n = 0
        for b in make_iter():
            n += int(images_of(b).shape[0])
        wall = time.perf_counter() - t0
        r = {"images": n, "wall_s": wall, "images_per_s": n / wall, "loadavg1": load0,
             "server_cpu_s": _cpu_s(server_pid) - cpu0}
        if endpoint:
            r["object_gets"] = _object_gets(endpoint) - before
        out.append(r)
    return out


def run_one(name: str, lat: str, cfg: dict) -> list[dict]:
    """Two epochs of one contender; each epoch's throughput, load and the object GETs it caused."""
    import sbloader

    endpoint = cfg["proxies"].get(lat) if name != "sbloader local" else None
    if name == "sbloader local":
        loader = (sbloader.read_images(cfg["root"], decode=False).map_batches(w.sbl_decode_files_batch)
                  .to_dataloader(BATCH, shuffle=True))
        make, of = (lambda: iter(loader)), (lambda b: b["image"])
    elif name == "sbloader s3":
        cache_dir = tempfile.mkdtemp(prefix="sbl-bench-cache-")
        cfg["cleanup"].append(cache_dir)
        loader = (sbloader.read_images(f"s3://{BUCKET}/images/", decode=False, filesystem=_s3fs(endpoint),
                                       cache_dir=cache_dir)
                  .map_batches(w.sbl_decode_files_batch).to_dataloader(BATCH, shuffle=True))
        make, of = (lambda: iter(loader)), (lambda b: b["image"])
    elif name == "torch s3":
        import torch.utils.data as tud

        dl = tud.DataLoader(Boto3ImageDataset(endpoint, cfg["keys"]), batch_size=BATCH, shuffle=True,
                            num_workers=2)
        make, of = (lambda: iter(dl)), (lambda b: b[0])
    else:
        import ray.data

        ds = ray.data.read_images(f"s3://{BUCKET}/images/", filesystem=_s3fs(endpoint), mode="RGB",
                                  include_paths=True, shuffle="files").map_batches(w.rd_crop_flip_batch,
                                                                                   batch_format="numpy")
        make, of = (lambda: ds.iter_torch_batches(batch_size=BATCH)), (lambda b: b["image"])
    return [dict(r, contender=name, latency_ms=lat, epoch=i + 1) for i, r in enumerate(_epochs(make, of, endpoint, cfg["server_pid"]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latencies", default="0,20,100", help="ms added to every request, comma-separated")
    ap.add_argument("--contenders", default="sbloader s3,torch s3,Ray Data s3")
    args = ap.parse_args()
    lats = [f"{float(x):g}" for x in args.latencies.split(",")]
    contenders = [c.strip() for c in args.contenders.split(",")]

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    proc, info = _start_server([float(x) for x in lats])
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    root = tempfile.mkdtemp(prefix="sbl-bench-remote-")
    cfg: dict = {"proxies": info["proxies"], "root": root, "cleanup": [root], "server_pid": proc.pid}
    try:
        from sbloader.datagen import write_jpeg_folder

        paths = write_jpeg_folder(root, args.images)
        cfg["keys"] = ["images/" + os.path.relpath(p, root) for p in paths]
        _upload(info["moto"], root)
        import sbloader
        from sbloader.sources.filesystems import LAST_LISTING, list_uris

        sbloader.init(num_cpus=2)
        list_uris([f"s3://{BUCKET}/images/"], (".jpg",), "image", filesystem=_s3fs(info["moto"]))
        listing = {"objects": LAST_LISTING.objects, "seconds": LAST_LISTING.seconds,
                   "seconds_per_1000": LAST_LISTING.seconds_per_1000}
        order = [("sbloader local", "0")] + [(c, lat) for lat in lats for c in contenders]
        for name, lat in order:  # warm-up, not recorded: Ray's workers, imports, the page cache
            if name != "torch s3":
                run_one(name, lat, cfg)
        rows: list[dict] = []
        for rnd in range(args.rounds):
            for name, lat in order:
                for r in run_one(name, lat, cfg):
                    r["round"] = rnd
                    rows.append(r)
                    print(json.dumps(r), flush=True)
        payload = {"rows": rows, "listing": listing, "images": args.images, "rounds": args.rounds,
                   "loadavg_end": os.getloadavg()}
        h.publish("remote", payload, _markdown(rows, listing, args), title="Images from S3 (moto + latency proxy)")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        for d in cfg["cleanup"]:
            shutil.rmtree(d, ignore_errors=True)


def _markdown(rows: list[dict], listing: dict, args: argparse.Namespace) -> str:
    def pick(name: str, lat: str, epoch: int, key: str = "images_per_s") -> list[float]:
        return [r[key] for r in rows if r["contender"] == name and r["latency_ms"] == lat and r["epoch"] == epoch]

    def med(name: str, lat: str, epoch: int) -> str:
        return h.fmt_range(h.summarize(pick(name, lat, epoch)), "{:.0f}")

    def ratio(a: tuple, b: tuple) -> str:
        pairs = [x / y for x, y in zip(pick(*a), pick(*b)) if y]
        return h.fmt_range(h.summarize(pairs), "{:.2f}")

    lats = sorted({r["latency_ms"] for r in rows if r["contender"] != "sbloader local"}, key=float)
    table = []
    for name in sorted({r["contender"] for r in rows}):
        for lat in (["0"] if name == "sbloader local" else lats):
            gets = [r.get("object_gets") for r in rows if r["contender"] == name and r["latency_ms"] == lat
                    and r["epoch"] == 2]
            scpu = [r["server_cpu_s"] / r["images"] * 1000 for r in rows if r["contender"] == name
                    and r["latency_ms"] == lat and r["epoch"] == 1]
            table.append({"contender": name, "latency ms": "local disk" if name == "sbloader local" else lat,
                          "epoch 1 img/s": med(name, lat, 1), "epoch 2 img/s": med(name, lat, 2),
                          "store CPU ms/img, epoch 1": h.fmt_range(h.summarize(scpu), "{:.1f}"),
                          "epoch 2 object GETs": h.fmt_range(h.summarize(gets), "{:.0f}") if name != "sbloader local"
                          else "–"})
    ratios = []
    for lat in lats:
        ratios.append({"latency ms": lat,
                       "sbloader s3 / local, epoch 1": ratio(("sbloader s3", lat, 1), ("sbloader local", "0", 1)),
                       "sbloader s3 / local, epoch 2": ratio(("sbloader s3", lat, 2), ("sbloader local", "0", 2)),
                       "sbloader / torch, epoch 1": ratio(("sbloader s3", lat, 1), ("torch s3", lat, 1)),
                       "sbloader / Ray Data, epoch 1": ratio(("sbloader s3", lat, 1), ("Ray Data s3", lat, 1))})
    loads = [r["loadavg1"] for r in rows]
    return (f"{args.images} JPEGs (320x240 to 640x480), decode + random-resized-crop 224 + flip, batches of 64, "
            f"consumer idle; {args.rounds} interleaved rounds (median (min–max)); every epoch timed from the "
            f"iterator's creation (start-up included). moto serves on 127.0.0.1 in its own process; a proxy adds "
            f"the latency to every request (HEAD, GET, LIST). sbloader and Ray Data share one embedded Ray "
            f"(num_cpus=2); torch's DataLoader runs 2 workers. The store (moto + proxies, Python) runs on the "
            f"same 2 cores: its CPU per image (column 'store CPU') is taken from the loaders, which a real "
            f"object store would not do.\n\n"
            + h.markdown_table(table) + "\n\n**Ratios, per round** (median (min–max)):\n\n"
            + h.markdown_table(ratios)
            + f"\n\nListing: {listing['objects']} objects in {listing['seconds']:.3f} s "
            f"({listing['seconds_per_1000']:.3f} s per 1,000 objects, no added latency).\n\n"
            f"Machine load (1-min loadavg at each epoch's start): median {h.median(loads):.1f}, "
            f"min {min(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} cores (other engineers' work "
            f"shares the machine).\n")


if __name__ == "__main__":
    main()
