"""A torchrun job over a tiny native ``from_items`` pipeline (480 rows of a few bytes, issue #46).

    torchrun --standalone --nproc-per-node=2 tiny_items_job.py --out DIR

Each rank writes ``DIR/rank{R}.json``: the ids of every batch of one epoch. The test
reads what the job printed (no shuffle-window warning: in-memory partitions are
uniform samples, so a batch already mixes the whole range).
"""
from __future__ import annotations

import argparse
import json
import os

import sbloader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=480)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    loader = sbloader.from_items([{"id": i} for i in range(args.rows)]).to_dataloader(batch_size=8, shuffle=True)
    batches = [[int(i) for i in b["id"]] for b in loader]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "batches": batches}, f)


if __name__ == "__main__":
    main()
