"""The embedded Ray's object store size, known before Ray starts (``sbloader/runtime/store_size.py``)."""
from __future__ import annotations

from sbloader.runtime.store_size import SHM_FLOOR, STORE_MAX, embedded_store_bytes, memory_bytes, store_bytes

GB = 10**9


def test_thirty_percent_of_memory_within_shm_and_the_cap():
    assert store_bytes(24 * GB, 24 * GB) == int(24 * GB * 0.3)
    # /dev/shm smaller than 30% of memory: 95% of it, but never below Ray's 10 GB floor
    assert store_bytes(100 * GB, 20 * GB) == 19 * GB
    assert store_bytes(100 * GB, 64 * 2**20) == SHM_FLOOR
    assert store_bytes(10_000 * GB, None) == STORE_MAX


def test_this_machine_gets_a_positive_size_below_its_memory():
    size = embedded_store_bytes()
    assert 0 < size <= 0.3 * memory_bytes()
