"""The node's budget of requests in flight (sbloader/sources/node_slots.py): shared by the
node's processes, freed by a process that dies holding slots, and taken by every request of
the process's gauge (counted, not timed: threads held on events, processes told when to go)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from sbloader.sources.inflight import Gauge
from sbloader.sources.node_slots import NodeSlots, node_limit

_TAKER = textwrap.dedent("""
    import sys
    from sbloader.sources.node_slots import NodeSlots
    slots = NodeSlots(5, sys.argv[1])
    got = [i for i in (slots.try_take() for _ in range(8)) if i is not None]
    print(len(got), flush=True)
    if sys.argv[2] == "hold":
        sys.stdin.readline()  # hold them until killed
""")


def _child(root: str, hold: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _TAKER, root, "hold" if hold else "go"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_the_node_budget_is_shared_by_processes_and_freed_by_a_dead_one(tmp_path):
    root = str(tmp_path / "slots")
    mine = NodeSlots(5, root)
    held = [mine.try_take() for _ in range(3)]
    assert None not in held and len(set(held)) == 3
    other = _child(root)
    assert other.stdout.readline().strip() == "2"  # 5 on the node, 3 held here
    other.wait(60)
    for i in held:
        mine.give(i)
    holder = _child(root, hold=True)
    assert holder.stdout.readline().strip() == "5"
    assert mine.try_take() is None  # another process holds the node's 5
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(mine.take()))
    waiter.start()  # waits on one of the holder's slots
    holder.kill()
    holder.wait(60)
    waiter.join(60)
    assert len(waited) == 1 and waited[0] is not None  # the dead holder's slot went to the waiter
    mine.give(waited[0])
    assert len({mine.try_take() for _ in range(5)} - {None}) == 5  # the dead one's slots are free
    assert mine.try_take() is None


def test_every_request_of_the_gauge_holds_a_node_slot(tmp_path):
    """A process allowed 4 requests on a node allowed 2: 2 in flight, the others wait for one to end."""
    root = str(tmp_path / "slots")
    gauge = Gauge(cap=4, node=NodeSlots(2, root))
    inside, release, lock = [], threading.Event(), threading.Lock()
    entered = threading.Semaphore(0)

    def request(n: int) -> None:
        with gauge.slot("ds", 4):
            with lock:
                inside.append(n)
            entered.release()
            release.wait(30)

    threads = [threading.Thread(target=request, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for _ in range(2):
        assert entered.acquire(timeout=30)
    assert not entered.acquire(timeout=0.5)  # no third while two hold the node's slots
    with lock:
        assert len(inside) == 2
    assert NodeSlots(2, root).try_take() is None  # the node's 2 are held (as another process sees it)
    release.set()
    for t in threads:
        t.join(30)
    assert sorted(inside) == [0, 1, 2, 3]


def test_the_node_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("SBLOADER_NODE_MAX_IN_FLIGHT", raising=False)
    assert node_limit() == 256
    monkeypatch.setenv("SBLOADER_NODE_MAX_IN_FLIGHT", "0")
    assert node_limit() == 0
    monkeypatch.setenv("SBLOADER_NODE_MAX_IN_FLIGHT", "many")
    with pytest.raises(ValueError, match="SBLOADER_NODE_MAX_IN_FLIGHT.*'many'"):
        node_limit()
