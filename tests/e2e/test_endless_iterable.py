"""An ``IterableDataset`` that never ends (a stream), with workers: batches keep coming, in torch's order.

torch's workers yield each batch as it is made; a loop over an endless stream takes what it
needs and stops. The loader must do the same on its pool (``local_start=False``) and after the
local workers hand the shards over to the pool (issue #44), where a shard ran as one block that
never came back. Each case runs in a child process with its own embedded Ray: a loader that
hangs must not leave a pool holding the session's CPUs.
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
import json, sys, itertools
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

if __name__ == "__main__":
    local = sys.argv[1] == "local"
    loader = sbloader.DataLoader(Stream(), batch_size=4, num_workers=2, local_start=local)
    got = [b.tolist() for b in itertools.islice(loader, {take})]
    want = [b.tolist() for b in itertools.islice(torch.utils.data.DataLoader(Stream(), batch_size=4, num_workers=2), {take})]
    print(json.dumps({{"got": got, "want": want}}), flush=True)
"""


@pytest.mark.parametrize("start", ["local", "pool"])
def test_an_endless_iterable_dataset_keeps_yielding_in_torchs_order(tmp_path, start):
    script = tmp_path / "endless.py"
    script.write_text(textwrap.dedent(CHILD.format(take=TAKE)))
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", SBLOADER_HANDOVER_AT="2")
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, str(script), start], capture_output=True, text=True, timeout=150,
                              env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{TAKE} batches of an endless stream did not come within 150 s ({start} start): "
                             f"the loader waits for a shard's end") from e
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    out = json.loads(lines[-1])
    assert out["got"] == out["want"]
