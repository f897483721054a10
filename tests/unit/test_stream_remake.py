"""A block of an ``IterableDataset``'s split epoch lost with its node is made again once, and what the
ranks take afterwards names the new block (issue #46; the e2e test on a cluster is
``tests/e2e/test_ray_cluster.py::test_an_iterable_dataset_split_across_ranks_goes_on_exactly_once_when_a_node_with_unfetched_blocks_dies``)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from sbloader.core.errors import SbloaderError
from sbloader.distributed.stream_epoch import StreamEpoch


class Ref:
    """A stand-in for an object ref: only its hex is used."""

    def __init__(self, name: str) -> None:
        self.name = name

    def hex(self) -> str:
        return self.name


def _block(name: str, seq: int, rows: tuple) -> SimpleNamespace:
    meta = SimpleNamespace(batch_rows=rows, num_rows=sum(rows), nbytes=100, node_id="lost", seq=seq, partition_id=seq)
    return SimpleNamespace(ref=Ref(name), meta=meta)


def _epoch() -> StreamEpoch:
    """Two ranks; shard 0 made 3 batches of 8 rows (block a), shard 1 batches of 8 and 4 (block b);
    production ended: 2 whole batches per rank, b's short batch cut into the ranks' last batches."""
    spec = SimpleNamespace(epoch=3, drop_last=False)
    ep = StreamEpoch(spec, 2, {})
    ep.executor = SimpleNamespace(release=lambda nbytes: None)
    ep._add_batches(_block("a", 0, (8, 8, 8)))
    ep._add_batches(_block("b", 1, (8, 4)))
    ep._plan_tail()
    ep.produced_all = True
    return ep


def _refs(batches: list) -> list:
    return [ref.hex() for b in batches for ref, *_ in b.pieces]


def test_a_lost_block_is_made_again_once_for_every_rank_that_asks_and_then_handed_out_in_its_place():
    ep = _epoch()
    made = []

    def make(seq: int, pid: int, source) -> Ref:
        made.append((seq, pid, source))
        time.sleep(0.2)  # both ranks ask while it runs
        return Ref(f"b{len(made) + 1}")

    got = []
    askers = [threading.Thread(target=lambda: got.append(ep.remake("b", make).hex())) for _ in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert made == [(1, 1, None)] and got == ["b2", "b2"], "the shard ran again once; both ranks got its block"
    assert _refs(ep.take(0, 2, None, 0.0, 60.0)) == ["a", "a"]
    assert _refs(ep.take(1, 2, None, 0.0, 60.0)) == ["a", "b2"], "a batch of the lost block names the new one"
    assert _refs(ep.take(0, 1, None, 0.0, 60.0)) == ["b2"] and _refs(ep.take(1, 1, None, 0.0, 60.0)) == ["b2"], \
        "the ranks' short last batches (cut from the lost block) name the new one"
    assert ep.remake("b", make).hex() == "b2" and made == [(1, 1, None)], "a late ask gets the block made again"
    assert ep.remake("b2", make).hex() == "b3" and ep.remake("b", make).hex() == "b3", "lost again: made again"


def test_a_block_the_epoch_never_made_is_refused_naming_the_epoch():
    with pytest.raises(SbloaderError, match="epoch 3 made no block zz"):
        _epoch().remake("zz", lambda seq, pid, source: Ref("never"))
