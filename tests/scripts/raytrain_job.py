"""A Ray Train ``TorchTrainer`` job whose train function builds the drop-in (``tests/e2e/test_ray_cluster.py``).

    RAY_ADDRESS=127.0.0.1:PORT python raytrain_job.py OUT N [--epochs 2] [--mix]

Two workers (Ray actors with a gloo process group, set up by Ray Train) each build
``sbloader.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)`` over an
N-sample dataset; each writes ``OUT/rank{R}.json``: per epoch, the ids it got. The
job's identity comes from the process group's store: two such jobs on one cluster
never share a coordinator.

``--mix``: a first ``fit`` on 2 workers reads the N-sample loader as above (``rank{R}.json``; none
when N is 0), then ``sbloader.mix`` of two sources (ids from 0 and from 1000, weights 2:1,
``MIX_SAMPLES`` = 48 samples per epoch); it reports rank 0's mixture state in a Ray Train
checkpoint at step 2 of epoch 0 and stops (each rank writes ``rank{R}-mix.json``); the same run
again (its name and storage) on 3 workers resumes from that checkpoint
(``ray.train.get_checkpoint()``) and reads the rest of epoch 0 and epoch 1
(``rank{R}-resumed.json``). One job of the test is both a plain job beside another and the
mixture's: one ``fit`` (a controller, two workers, their pools) fewer than a job for each.
"""
from __future__ import annotations

import json
import os
import sys

import torch

# The mixture's samples per rank and epoch. 48 (it was 96): after the resume on 3 ranks the sources still
# run past two epochs each (~176 rows of the 60-row source, ~88 of the 30-row one), and each source epoch
# ended is a pipeline started again (seconds on this machine): half the steps, half the restarts.
MIX_SAMPLES = 48


class Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its id."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return self.offset + i


def train_func(config: dict) -> None:
    """Each rank reads ``config["epochs"]`` epochs of an ``n``-sample drop-in and writes their ids."""
    import gc

    import torch.distributed as dist

    import sbloader

    loader = sbloader.DataLoader(Ids(config["n"]), batch_size=8, shuffle=True, num_workers=2)
    epochs = []
    for _ in range(config["epochs"]):
        epochs.append([int(i) for batch in loader for i in batch])
    with open(os.path.join(config["out"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"epochs": epochs}, f)
    del loader  # its coordinator lets its pool go (the mixture after it needs the CPUs)
    gc.collect()


def mix_func(config: dict) -> None:
    import tempfile

    import ray.train
    import torch.distributed as dist

    import sbloader

    rank, resumed = dist.get_rank(), ray.train.get_checkpoint()
    if resumed is None and config["n"]:
        train_func(config)
    mixed = sbloader.mix({"a": Ids(60, 0), "b": Ids(30, 1000)}, weights={"a": 2, "b": 1}, seed=5)
    loader = sbloader.DataLoader(mixed, batch_size=8, shuffle=True, num_samples=MIX_SAMPLES)
    if resumed is not None:
        with resumed.as_directory() as d, open(os.path.join(d, "loader.json")) as f:
            loader.load_state_dict(json.load(f))
    epochs: list = []
    for _ in range(2):
        epochs.append([])
        for step, batch in enumerate(loader):
            epochs[-1] += [int(i) for i in batch]
            if resumed is None and step == 2:  # a checkpoint, then the job stops (a preemption)
                with tempfile.TemporaryDirectory() as d:
                    if rank == 0:
                        with open(os.path.join(d, "loader.json"), "w") as f:
                            json.dump(loader.state_dict(), f)
                    ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d)
                                     if rank == 0 else None)
                with open(os.path.join(config["out"], f"rank{rank}-mix.json"), "w") as f:
                    json.dump({"epochs": epochs}, f)
                return
    with open(os.path.join(config["out"], f"rank{rank}-resumed.json"), "w") as f:
        json.dump({"epochs": epochs}, f)


def _mix(config: dict) -> None:
    """The ``--mix`` job: stopped on 2 workers, then the same run (its name and storage: Ray Train
    resumes it from its latest checkpoint) on 3."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    for workers in (2, 3):
        trainer = TorchTrainer(mix_func, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                                            resources_per_worker={"CPU": 0.25}),
                               run_config=RunConfig(name="mix", storage_path=os.path.join(config["out"],
                                                                                         "ray_results")))
        result = trainer.fit()
        assert result.checkpoint is not None, "the stopped run reported no checkpoint"


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out, n = sys.argv[1], int(sys.argv[2])
    epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 2
    import sbloader

    sbloader.init()  # joins RAY_ADDRESS (token mode on when a token is available)
    config = {"out": out, "n": n, "epochs": epochs}
    if "--mix" in sys.argv:
        _mix(config)
        ray.shutdown()
        return
    trainer = TorchTrainer(train_func, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                        resources_per_worker={"CPU": 0.25}),
                           run_config=RunConfig(storage_path=os.path.join(out, "ray_results")))
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
