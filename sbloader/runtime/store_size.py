"""The embedded Ray's object store size, known before Ray starts.

A pipeline's default memory budget is a share of the cluster's object store
(:data:`~sbloader.executor.budget.DEFAULT_STORE_SHARE`), and its default shuffle
window a share of that budget: both decide which rows a shuffled batch holds. An
epoch that starts on local processes while the embedded Ray is still starting
(:mod:`sbloader.loaders.native_start`) must cut the batches a Ray-only run cuts, so
it needs that size before Ray can say it. Ray sizes its store from the memory
*available* at its start, which moves; sbloader starts its embedded Ray with the
size this module computes, by Ray's rule on the memory the process may use in all:

- 30% of the machine's memory (or of the cgroup's limit, where lower);
- on Linux, at most 95% of ``/dev/shm`` (but not below 10 GB, where Ray falls back to disk);
- at most 200 GB.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

STORE_SHARE = 0.3  # ray_constants.DEFAULT_OBJECT_STORE_MEMORY_PROPORTION
STORE_MAX = 200 * 10**9  # ray_constants.DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES
SHM_FLOOR = 10**10  # ray_constants.REQUIRE_SHM_SIZE_THRESHOLD


def _cgroup_limit() -> Optional[int]:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def memory_bytes() -> int:
    """The memory this process may use in all: the machine's, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def shm_bytes() -> Optional[int]:
    """The size of ``/dev/shm`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def store_bytes(memory: int, shm: Optional[int]) -> int:
    """The object store size for a node of ``memory`` bytes with ``shm`` bytes of ``/dev/shm`` (pure)."""
    cap = STORE_MAX if shm is None else min(STORE_MAX, max(SHM_FLOOR, int(shm * 0.95)))
    return min(int(memory * STORE_SHARE), cap)


def embedded_store_bytes() -> int:
    """The object store size sbloader gives the embedded Ray on this machine."""
    return store_bytes(memory_bytes(), shm_bytes())
