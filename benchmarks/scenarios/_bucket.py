"""Helpers of ``bucket_latency``: the lean server in a process of its own, its counts per
bucket, a torch Dataset over boto3, and the plot of requests in flight over time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import BENCH_DIR


def bucket_folder(paths: list[str], root: str, dest: Path) -> tuple[Path, list[str]]:
    """``dest`` holding exactly ``paths`` (hard links, the layout under ``root`` kept) and their keys."""
    keys = [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]
    for p, k in zip(paths, keys):
        d = dest / k
        if not d.exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, d)
            except OSError:
                d.write_bytes(Path(p).read_bytes())
    return dest, keys


class Server:
    """``benchmarks/_lean_s3.py`` serving ``folder`` in one bucket per latency (a child process)."""

    def __init__(self, folder: Path, latencies: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(BENCH_DIR / "_lean_s3.py"), str(folder)] + latencies,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.endpoint, self.buckets = info["endpoint"], info["buckets"]

    def stats(self, bucket: str, reset: bool = False, touch: bool = False) -> dict:
        """The bucket's counts (``object_gets``, ``object_heads``, ``requests``, ``server_cpu_s``,
        ``peak_in_flight``, ``timeline``); ``touch``: its objects get new versions first (a run then
        starts as a new process would: no index or footer a Ray worker remembers applies)."""
        url = (f"{self.endpoint}/__sbloader_proxy_stats?bucket={bucket}" + ("&reset=1" if reset else "")
               + ("&touch=1" if touch else ""))
        with urllib.request.urlopen(url) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """Stop the server."""
        self.proc.stdin.close()
        self.proc.wait(30)


def store_metrics(before: dict, after: dict) -> dict:
    """What the store saw during a run: requests, GETs, HEADs, its CPU per request, peak in flight."""
    req = after["requests"]
    return {"store_requests": req, "store_gets": after["object_gets"], "store_heads": after["object_heads"],
            "store_cpu_ms_per_req": 1000 * (after["server_cpu_s"] - before["server_cpu_s"]) / max(1, req),
            "store_peak_in_flight": after["peak_in_flight"]}


class Boto3Images:
    """A map-style Dataset reading each object with boto3 (one client per worker), as users write one."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str]) -> None:
        self.endpoint, self.bucket, self.keys, self._client = endpoint, bucket, keys, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Any:
        import torch

        from benchmarks import _image_workload as w

        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="x",
                                        aws_secret_access_key="x", region_name="us-east-1")
        data = self._client.get_object(Bucket=self.bucket, Key=self.keys[i])["Body"].read()
        return torch.from_numpy(w.T.decode_crop_flip(data, w.SIZE, w.process_rng())), w.label_of(self.keys[i])


def plot_in_flight(timelines: dict, path: Path, title: str) -> Optional[Path]:
    """Requests in flight at the store over time, one line per contender (a step plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for name, tl in timelines.items():
        if tl:
            ax.step([t for t, _ in tl], [n for _, n in tl], where="post", label=name, linewidth=0.8)
    ax.set_xlabel("seconds since the dataset was created (the listing, then the first epoch)")
    ax.set_ylabel("requests in flight")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
