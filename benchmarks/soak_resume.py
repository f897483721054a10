"""Soak test of exactly-once resume: SIGKILL at random steps, resume on random world sizes.

Each *chain* is one epoch of ``tests/scripts/resume_job.py`` (a torchrun job over
``--samples`` ids, batch 4, 2 loader workers, random per-sample delays, a JSON
checkpoint of the loader state every 3 steps). A chain runs legs: each leg is a
torchrun job of 1 to 3 ranks (drawn at random) that loads the checkpoint and is
SIGKILLed whole (torchrun and every rank) at a random step before the end of
the epoch; after 1 to 4 kills a last leg, of a random world size again, runs to
the end (a chain whose epoch runs out before its planned kills leaves a shortfall
that further chains make up, so the soak has at least ``--kills`` kills). The
samples a killed leg committed are the ids its ranks logged at steps up to the
checkpoint it left behind; the final leg commits all it logged (padding rows
excluded). Over all chains we count samples lost (never committed)
and duplicated (committed twice or more): the target is 0 and 0. We also check
that every checkpoint's ledger counts exactly the samples committed by then,
and count checkpoints whose ledger is not a prefix (out-of-order consumption).

Most chains use the default non-deterministic delivery (``in_order=False``); one
in four uses ``in_order=True``.

Run: ``python benchmarks/soak_resume.py`` (at least 24 kills, ~5-10 min on 2
cores); ``--quick`` for 3 kills. Writes ``benchmarks/results/soak_resume.json``
and ``.md`` (``--quick``: ``soak_resume_quick.*``). Exits 1 if a sample was lost
or duplicated.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "scripts"))
import _harness as h  # noqa: E402
import resume_runs  # noqa: E402

from sbloader.core import ledger  # noqa: E402
from sbloader.core.split import split_epoch  # noqa: E402

BATCH = 4  # resume_job.py's default --batch-size
EVERY = 3  # resume_job.py's default --ckpt-every


def _remaining(ckpt: Path, n: int) -> int:
    """Samples not yet consumed according to the checkpoint file."""
    if not ckpt.exists():
        return n
    state = json.loads(ckpt.read_text())["loader"]
    return n - ledger.count(state["consumed"])


def run_chain(index: int, seed: int, kills: int, n: int, workdir: Path, delay: float, timeout: float,
              log=print) -> dict:
    """One epoch with ``kills`` random SIGKILLs and world-size changes; its accounting."""
    rng = random.Random(f"{seed}:{index}")
    in_order = int(index % 4 == 3)
    out = workdir / f"chain{index}"
    out.mkdir(parents=True)
    chain = resume_runs.Chain(out, n=n)
    flags = dict(samples=n, max_delay=delay, in_order=in_order)
    attempt = 0
    while True:
        nproc = rng.randint(1, 3)
        start = resume_runs.ckpt_step(chain.ckpt)
        per_rank = split_epoch(_remaining(chain.ckpt, n), BATCH, nproc, False).per_rank
        # a kill strictly before the leg's last step (a kill at the last step would end the epoch)
        kill_at = start + rng.randint(1, per_rank - 1) if attempt < kills and per_rank > 1 else -1
        leg = resume_runs.run_leg(out, chain.ckpt, nproc, attempt, kill_at, timeout, **flags)
        chain.legs.append(leg)
        log(f"chain {index} leg {attempt}: {nproc} ranks from step {start}, "
            + (f"killed at {kill_at} (checkpoint {leg.ckpt_step})" if leg.killed else "to the end")
            + f", {leg.seconds:.1f} s")
        attempt += 1
        if not leg.killed:
            break

    # every checkpoint's ledger counts what the chain had committed when it was saved
    states = {(s["attempt"], s["step"]): s["loader"] for s in resume_runs.checkpoints(chain.ckpt)}
    mismatches, committed = [], 0
    for a, leg in enumerate(chain.legs[:-1]):
        committed += len(leg.committed())
        state = states.get((a, leg.ckpt_step))
        if state is not None and ledger.count(state["consumed"]) != committed:
            mismatches.append({"leg": a, "step": leg.ckpt_step, "ledger": ledger.count(state["consumed"]),
                               "committed": committed})
    mid_epoch = [s for s in states.values() if s["epoch_seed"] is not None]
    padded = sum(1 for leg in chain.legs for entries in leg.steps.values() for e in entries if e.get("pad"))
    return {
        "chain": index,
        "in_order": bool(in_order),
        "legs": [{"nproc": lg.nproc, "kill_at": lg.kill_at if lg.killed else None, "resumed_from_step": lg.start_step,
                  "checkpoint_step": lg.ckpt_step if lg.killed else None, "committed": len(lg.committed()),
                  "seconds": round(lg.seconds, 2)} for lg in chain.legs],
        "kills": sum(lg.killed for lg in chain.legs),
        "world_size_changes": sum(a.nproc != b.nproc for a, b in zip(chain.legs, chain.legs[1:])),
        "kills_before_a_new_checkpoint": sum(lg.killed and lg.ckpt_step == lg.start_step for lg in chain.legs),
        "samples": n,
        "committed": len(chain.committed()),
        "lost": chain.lost(),
        "duplicated": {str(k): v for k, v in chain.duplicated().items()},
        "ledger_mismatches": mismatches,
        "checkpoints": len(states),
        "non_prefix_checkpoints": sum(len(s["consumed"]) >= 2 for s in mid_epoch),
        "max_ledger_ranges": max((len(s["consumed"]) for s in mid_epoch), default=0),
        "batches_with_padding": padded,
    }


def plan_kills(total: int, rng: random.Random) -> list:
    """Kills per chain (1 to 4 each) adding up to ``total``."""
    out = []
    while sum(out) < total:
        out.append(min(rng.randint(1, 4), total - sum(out)))
    return out


def render(payload: dict) -> str:
    t = payload["totals"]
    lines = [
        f"{t['chains']} chains (epochs of {payload['config']['samples']} samples, batch {BATCH}, 2 loader workers, "
        f"per-sample delay up to {payload['config']['max_delay'] * 1000:.0f} ms, checkpoint every {EVERY} steps), "
        f"{t['kills']} SIGKILLs of the whole torchrun job at random steps, "
        f"{t['world_size_changes']} world-size changes (1-3 ranks), {t['legs']} jobs in all.",
        "",
        "| samples expected | committed | **lost** | **duplicated** | ledger mismatches | checkpoints | "
        "non-prefix ledgers | max ledger ranges | kills before a new checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {t['samples']} | {t['committed']} | **{t['lost']}** | **{t['duplicated']}** | {t['ledger_mismatches']} | "
        f"{t['checkpoints']} | {t['non_prefix_checkpoints']} | {t['max_ledger_ranges']} | "
        f"{t['kills_before_a_new_checkpoint']} |",
        "",
        f"Tail batches with padding rows (repeats marked by the loader, never counted): "
        f"{t['batches_with_padding']}.",
        "",
        f"Verdict: **{'PASS' if t['lost'] == 0 and t['duplicated'] == 0 and t['ledger_mismatches'] == 0 else 'FAIL'}** "
        "(target: 0 lost, 0 duplicated).",
        "",
        f"Wall time {payload['wall_s'] / 60:.1f} min ({payload['config']['parallel']} chains at a time); job time "
        f"median {t['job_s_median']:.1f} s (min {t['job_s_min']:.1f}, max {t['job_s_max']:.1f}), start-up and "
        f"Ray included. Load average at start/end: {payload['load_start']} / {payload['load_end']} "
        f"(other sessions share this machine; the counts do not depend on timing, only which kill points occur).",
        "",
        "## Chains",
        "",
        "| chain | mode | legs: ranks@kill step (checkpoint) | committed | lost | duplicated | non-prefix ledgers |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in payload["chains"]:
        legs = " → ".join(f"{lg['nproc']}@{lg['kill_at']} ({lg['checkpoint_step']})" if lg["kill_at"] is not None
                          else f"{lg['nproc']}@end" for lg in c["legs"])
        dup = sum(v - 1 for v in c["duplicated"].values())
        lines.append(f"| {c['chain']} | {'in_order' if c['in_order'] else 'as ready'} | {legs} | {c['committed']} | "
                     f"{len(c['lost'])} | {dup} | {c['non_prefix_checkpoints']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 kills")
    p.add_argument("--kills", type=int, default=24, help="SIGKILLs in all (at least 20 for the full soak)")
    p.add_argument("--samples", type=int, default=482, help="not a multiple of 12: tails that need padding")
    p.add_argument("--max-delay", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=2, help="chains run side by side")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    kills = 3 if args.quick else args.kills
    rng = random.Random(args.seed)
    lock = threading.Lock()

    def log(msg: str) -> None:
        with lock:
            print(msg, flush=True)

    load_start = [round(x, 1) for x in os.getloadavg()]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak_resume_") as tmp:
        chains: list = []
        with ThreadPoolExecutor(max(1, args.parallel)) as pool:
            # a chain whose epoch runs out before its planned kills leaves a shortfall: more chains make it up
            while (shortfall := kills - sum(c["kills"] for c in chains)) > 0:
                first = len(chains)
                futures = [pool.submit(run_chain, first + i, args.seed, k, args.samples, Path(tmp), args.max_delay,
                                       args.timeout, log) for i, k in enumerate(plan_kills(shortfall, rng))]
                chains += [f.result() for f in futures]
    wall = time.monotonic() - t0
    jobs = [lg["seconds"] for c in chains for lg in c["legs"]]
    totals = {
        "chains": len(chains),
        "legs": len(jobs),
        "kills": sum(c["kills"] for c in chains),
        "world_size_changes": sum(c["world_size_changes"] for c in chains),
        "kills_before_a_new_checkpoint": sum(c["kills_before_a_new_checkpoint"] for c in chains),
        "samples": sum(c["samples"] for c in chains),
        "committed": sum(c["committed"] for c in chains),
        "lost": sum(len(c["lost"]) for c in chains),
        "duplicated": sum(sum(c["duplicated"].values()) - len(c["duplicated"]) for c in chains),
        "ledger_mismatches": sum(len(c["ledger_mismatches"]) for c in chains),
        "checkpoints": sum(c["checkpoints"] for c in chains),
        "non_prefix_checkpoints": sum(c["non_prefix_checkpoints"] for c in chains),
        "max_ledger_ranges": max(c["max_ledger_ranges"] for c in chains),
        "batches_with_padding": sum(c["batches_with_padding"] for c in chains),
        "job_s_median": statistics.median(jobs),
        "job_s_min": min(jobs),
        "job_s_max": max(jobs),
    }
    payload = {
        "command": h.command_line(),
        "machine": h.machine_info(),
        "config": {"kills": kills, "samples": args.samples, "batch_size": BATCH, "ckpt_every": EVERY,
                   "loader_workers": 2, "max_delay": args.max_delay, "seed": args.seed, "parallel": args.parallel,
                   "world_sizes": [1, 2, 3]},
        "totals": totals,
        "wall_s": round(wall, 1),
        "load_start": load_start,
        "load_end": [round(x, 1) for x in os.getloadavg()],
        "chains": chains,
    }
    md = render(payload)
    print(md)
    if not args.no_write:
        name = "soak_resume_quick" if args.quick else "soak_resume"
        jpath, mpath = h.write_results(name, payload, md, title="Exactly-once resume soak: random SIGKILLs "
                                                                "and world sizes")
        print(f"wrote {jpath} and {mpath}")
    ok = totals["lost"] == 0 and totals["duplicated"] == 0 and totals["ledger_mismatches"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
