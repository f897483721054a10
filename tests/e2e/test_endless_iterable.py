"""An ``IterableDataset`` that never ends (a stream), with workers: batches keep coming, in torch's order.

torch's workers yield each batch as it is made; a loop over an endless stream takes what it
needs and stops. The loader must do the same on its pool (``local_start=False``) and after the
local workers hand the shards over to the pool (issue #44), where a shard ran as one block that
never came back. Both cases run in one child process with its own embedded Ray (the local start
first, as a fresh process's first loader; each loop's iterator dropped before the next): a loader
that hangs must not leave a pool holding the session's CPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TAKE = 60

CHILD = """
import json, itertools
import torch
from torch.utils.data import IterableDataset, get_worker_info
import sbloader

class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        w = info.id if info is not None else 0
        i = 0
        while True:  # never ends
            yield torch.tensor(1_000_000 * w + i)
            i += 1

def take(loader):
    it = iter(loader)
    got = [b.tolist() for b in itertools.islice(it, {take})]
    del it  # the loop stops: its epoch (and the pool's CPUs) go with the iterator
    return got


if __name__ == "__main__":
    want = take(torch.utils.data.DataLoader(Stream(), batch_size=4, num_workers=2))
    for start in ("local", "pool"):  # a fresh process's first loader, then one on the pool alone
        got = take(sbloader.DataLoader(Stream(), batch_size=4, num_workers=2, local_start=start == "local"))
        print(json.dumps({{"start": start, "got": got, "want": want}}), flush=True)
"""


def test_an_endless_iterable_dataset_keeps_yielding_in_torchs_order(tmp_path):
    """A fresh process's loader with its local start (the shards handed over to the pool after 2 batches),
    then one on the pool from the start (``local_start=False``), in one child process."""
    script = tmp_path / "endless.py"
    script.write_text(textwrap.dedent(CHILD.format(take=TAKE)))
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", SBLOADER_HANDOVER_AT="2")
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"{TAKE} batches of an endless stream did not come within 240 s (finished: {out!r}): "
                             f"the loader waits for a shard's end") from e
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and [r["start"] for r in lines] == ["local", "pool"], \
        f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    for r in lines:
        assert r["got"] == r["want"], f"{r['start']} start: not torch's order"
