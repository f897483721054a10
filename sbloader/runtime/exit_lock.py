"""The C library's exit-handler lock, inherited held by a forked child, set free there.

A C++ static with a destructor registers it with the C library (``__cxa_atexit``) the first
time it is made, under glibc's one exit-handler lock. A child forked while another thread of
the parent was inside that lock inherits it held, by a thread that does not exist in the
child: the child's first C++ static waits for it forever. glibc frees its other locks in a
forked child (malloc's, stdio's); not this one. A loader's start has such threads: the
background Ray start loads Ray's C++ libraries and makes their statics for seconds, and Ray's
own C++ threads make theirs as they first run, while the local start forks its workers. A local
worker then hung in torch's first call (``torch.set_num_threads(1)``, its thread pool), or in
pyarrow's first row-group read (a static version table), and the epoch with it: the loop waited
for good (CI, ``tests/ray/test_native_start.py``, twice in seven runs of the suite; one fork in
twenty under load).

:func:`free_in_child` runs right after the fork in each local worker
(:mod:`~sbloader.loaders.fork_safe`) and in every child of a process that loaded Ray
(:mod:`~sbloader.runtime.fork_child`: a torch ``DataLoader`` of the user's own meets the same
wait), once per child (about 0.6 ms: a thread's start). It asks for the lock from a probe thread.
Free, the probe is done within microseconds. Held, the probe waits on the lock's futex; the kernel names that
futex's address (``/proc/self/task/<tid>/syscall``). Where that address lies in glibc's own
writable data and the wait is glibc's private lock wait, the lock word is set free and the probe
woken: the lock is then as it is in a child forked a moment later. The parent's thread was inside
the lock for a few instructions only (a registration); a registration it had begun is at most
an entry marked in use and empty, which an exit skips (and a worker ends with ``os._exit``,
which runs none). Anywhere else (not Linux and glibc, another architecture, an address or a
wait not glibc's) nothing is touched.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from typing import Optional

PROBE_WAIT_S = 0.05  # a free lock is taken within microseconds; past this the probe is waiting on it
FREED_WAIT_S = 1.0  # the probe, woken, takes the lock and returns within this
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 0x80, 0x81
_LOCKED_WAITING = 2  # glibc's lock word while a thread waits on it

_TOKEN = ctypes.c_char()  # the probe's registrations name this "library", so they are removed at once


def _glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc on Linux (None elsewhere)."""
    if not sys.platform.startswith("linux") or platform.machine() not in _FUTEX_SYSCALL:
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        libc = ctypes.CDLL(None)
        libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        libc.__cxa_finalize.argtypes = [ctypes.c_void_p]
        libc.syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
        return libc
    except (ValueError, OSError, AttributeError):
        return None


_LIBC = _glibc()  # found in the parent: a child only uses it


def _probe(libc: ctypes.CDLL, done: threading.Event, tid: list) -> None:
    tid.append(threading.get_native_id())
    free = ctypes.cast(libc.free, ctypes.c_void_p)
    libc.__cxa_atexit(free, None, ctypes.addressof(_TOKEN))  # free(NULL) at the finalize just below
    libc.__cxa_finalize(ctypes.addressof(_TOKEN))
    done.set()


def _waited_futex(tid: int) -> Optional[int]:
    """The address of the glibc private lock the thread ``tid`` waits on (None: it waits on no such lock)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) < 4 or fields[0] != str(_FUTEX_SYSCALL[platform.machine()]):
        return None
    addr, op, value = (int(x, 16) for x in fields[1:4])
    if op != _FUTEX_WAIT_PRIVATE or value != _LOCKED_WAITING:
        return None
    return addr


def in_glibc_data(addr: int, maps: str) -> bool:
    """Whether ``addr`` lies in the C library's writable data: its writable mapping of ``libc.so``, or the
    anonymous mapping right after it (its zeroed data). ``maps`` is ``/proc/self/maps``' text."""
    lines = maps.splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if len(fields) < 6 or "/libc.so" not in fields[5] or "w" not in fields[1]:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if i + 1 < len(lines):
            nxt = lines[i + 1].split()
            nlo, nhi = (int(x, 16) for x in nxt[0].split("-"))
            if nlo == hi and len(nxt) == 5 and "w" in nxt[1]:  # no path: anonymous
                hi = nhi
        if lo <= addr < hi:
            return True
    return False


_DONE: dict = {"pid": None, "result": "left"}  # this process's answer (a child asks once, from either hook)


def free_in_child(wait_s: float = PROBE_WAIT_S) -> str:
    """(In a child just forked) Set the exit-handler lock free if the fork left it held. Returns ``"free"``
    (it was), ``"freed"`` (it was held and is free now), or ``"left"`` (held, or unknown here, and left
    as it was). Asked again in the same process, the first answer is returned at once."""
    if _DONE["pid"] == os.getpid():
        return _DONE["result"]
    result = _free(wait_s)
    _DONE.update(pid=os.getpid(), result=result)
    return result


def _free(wait_s: float) -> str:
    libc = _LIBC
    if libc is None:
        return "left"
    done, tid = threading.Event(), []
    threading.Thread(target=_probe, args=(libc, done, tid), name="sbloader-exit-lock", daemon=True).start()
    if done.wait(wait_s):
        return "free"
    addr = None
    for _ in range(20):  # the probe is on its way into the wait: the kernel names the futex once it is in
        addr = _waited_futex(tid[0]) if tid else None
        if addr is not None or done.wait(0.005):
            break
    if done.is_set():
        return "free"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "left"
    if addr is None or not in_glibc_data(addr, maps):
        return "left"
    ctypes.c_int.from_address(addr).value = 0
    libc.syscall(_FUTEX_SYSCALL[platform.machine()], addr, _FUTEX_WAKE_PRIVATE, 1)
    return "freed" if done.wait(FREED_WAIT_S) else "left"
