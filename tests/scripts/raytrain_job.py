"""A Ray Train ``TorchTrainer`` job whose train function builds the drop-in (``tests/e2e/test_ray_cluster.py``).

    RAY_ADDRESS=127.0.0.1:PORT python raytrain_job.py OUT N [--epochs 2]

Two workers (Ray actors with a gloo process group, set up by Ray Train) each build
``sbloader.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)`` over an
N-sample dataset; each writes ``OUT/rank{R}.json``: per epoch, the ids it got. The
job's identity comes from the process group's store: two such jobs on one cluster
never share a coordinator.
"""
from __future__ import annotations

import json
import os
import sys

import torch


class Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its id."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def train_func(config: dict) -> None:
    import torch.distributed as dist

    import sbloader

    loader = sbloader.DataLoader(Ids(config["n"]), batch_size=8, shuffle=True, num_workers=2)
    epochs = []
    for _ in range(config["epochs"]):
        epochs.append([int(i) for batch in loader for i in batch])
    with open(os.path.join(config["out"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"epochs": epochs}, f)


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out, n = sys.argv[1], int(sys.argv[2])
    epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 2
    import sbloader

    sbloader.init()  # joins RAY_ADDRESS (token mode on when a token is available)
    trainer = TorchTrainer(train_func, train_loop_config={"out": out, "n": n, "epochs": epochs},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                        resources_per_worker={"CPU": 0.25}),
                           run_config=RunConfig(storage_path=os.path.join(out, "ray_results")))
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
