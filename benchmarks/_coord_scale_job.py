"""One simulated epoch for ``bench_coordinator_scale.py`` (benchmark only), in its own embedded Ray.

    python benchmarks/_coord_scale_job.py --world W --per-rank N --hosts H [--kill S] --out FILE

Runs with whatever sbloader ``PYTHONPATH`` names first (the revision being measured):
``sbloader.distributed.simulate.simulate`` with the stand-in executor allowed 24
ready batches per rank (both revisions alike), and writes its result, the machine's
load average and the share of the 2 cores other processes took meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import sbloader  # noqa: E402
from sbloader.distributed.sim_epoch import sim_spec  # noqa: E402
from sbloader.distributed.simulate import SimConfig, simulate  # noqa: E402


class Cfg(SimConfig):
    """The simulated epoch with the same executor allowance in every revision (pickled by value)."""

    def spec(self):  # noqa: D401 - same contract as SimConfig.spec
        return sim_spec(self.epoch, self.world_size, self.per_rank, self.batch_size, in_order=self.in_order,
                        nodes=self.nodes, ahead=24 * self.world_size)


def _busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--per-rank", type=int, required=True)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--kill", type=float, default=None)
    ap.add_argument("--rebuild-timeout", type=float, default=30.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sbloader.init(num_cpus=8, object_store_memory=512 * 2**20)
    cfg = Cfg(a.world, a.per_rank, rate=a.rate, nodes=max(1, a.world // 8), name=f"scale-{a.world}",
              rebuild_timeout_s=a.rebuild_timeout)
    load0, (b0, t0) = os.getloadavg(), _busy()
    w0 = time.time()
    out = simulate(cfg, hosts=a.hosts, kill_after_s=a.kill)
    b1, t1 = _busy()
    out.update(loadavg_before=load0, loadavg_after=os.getloadavg(), machine_busy_frac=(b1 - b0) / max(1, t1 - t0),
               run_wall_s=time.time() - w0, sbloader_path=os.path.dirname(sbloader.__file__))
    with open(a.out, "w") as f:
        json.dump(out, f, default=str)
    sbloader.shutdown()


if __name__ == "__main__":
    main()
