"""A dataset whose every item segfaults its worker, for the tests of a local worker's death (issue #45).

Imported by the scripts that ``tests/unit/test_torch_loader.py`` and ``tests/ray/test_local_worker_death.py``
run in fresh processes (``tests/scripts`` on their path): there torch's SIGCHLD handler is not installed, as in
the drop-in, whose local workers' iterator runs in the loader's fetch thread."""
from __future__ import annotations

import ctypes
import os

import torch.utils.data


class Segfaults(torch.utils.data.Dataset):
    """``n`` items, each a read of address 0."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        return ctypes.string_at(0)


def quiet(_: int) -> None:
    """A ``worker_init_fn``: the worker's stderr to /dev/null (torch's worker prints its segfault there)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


class ExitsOne(torch.utils.data.Dataset):
    """``n`` items, each ends its worker with exit code 1 (a worker that died without a signal)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        os._exit(1)
