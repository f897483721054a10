"""PyTorch Lightning training with the drop-in (``tests/e2e/test_launchers.py``).

    python lightning_job.py OUT STRATEGY DEVICES [--stop-at STEP [--go-on]] [--resume CKPT] [--mix]

The model records the sample ids of every batch its ``training_step`` receives;
each rank writes ``OUT/rank{R}[-resumed].json`` (per epoch, the ids). ``--stop-at``
saves a checkpoint at that global step of the first epoch and exits (a
preemption); with ``--go-on`` the run saves the same checkpoint and what each rank saw
by then (``OUT/rank{R}-stopped.json``), then trains on to its end uninterrupted (the
checkpoint is the same file a stopped run leaves: what the loader had consumed at
that step); ``--resume`` continues from one with ``Trainer.fit(ckpt_path=...)``:
Lightning restores the loader's ``state_dict`` itself. ``--mix``: the loader reads
``sbloader.mix`` of two sources (ids from 0 and from 1000, weights 2:1), 96 samples per epoch.
"""
from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch

import sbloader

N = 96


class Ids(torch.utils.data.Dataset):
    """Sample ``i``: its id (``offset + i``) and a feature vector."""

    def __init__(self, n: int = N, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"id": self.offset + i, "x": torch.full((4,), float(self.offset + i))}


class Model(L.LightningModule):
    """A linear model that logs the ids it trains on."""

    def __init__(self, out: str, stop_at: int | None, resumed: bool, mix: bool = False, go_on: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.out, self.stop_at, self.resumed, self.mix, self.go_on = out, stop_at, resumed, mix, go_on
        self.seen: dict[int, list[int]] = {}

    def train_dataloader(self):
        if self.mix:
            mixed = sbloader.mix({"a": Ids(60, 0), "b": Ids(30, 1000)}, weights={"a": 2, "b": 1}, seed=5)
            return sbloader.DataLoader(mixed, batch_size=8, shuffle=True, num_samples=N)
        return sbloader.DataLoader(Ids(), batch_size=8, shuffle=True, num_workers=2)

    def training_step(self, batch, idx):
        self.seen.setdefault(self.current_epoch, []).extend(int(i) for i in batch["id"])
        if self.stop_at is not None and self.global_step == self.stop_at:
            self.trainer.save_checkpoint(os.path.join(self.out, "mid.ckpt"))
            self.dump("-stopped" if self.go_on else "")
            self.trainer.strategy.barrier()
            if not self.go_on:
                os._exit(0)  # a preemption right after the checkpoint
        return self.lin(batch["x"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        self.dump()

    def dump(self, suffix: str = "") -> None:
        name = f"rank{self.global_rank}{'-resumed' if self.resumed else ''}{suffix}.json"
        with open(os.path.join(self.out, name), "w") as f:
            json.dump({str(k): v for k, v in self.seen.items()}, f)


def main() -> None:
    out, strategy, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stop_at = int(sys.argv[sys.argv.index("--stop-at") + 1]) if "--stop-at" in sys.argv else None
    resume = sys.argv[sys.argv.index("--resume") + 1] if "--resume" in sys.argv else None
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(out, stop_at, resume is not None, "--mix" in sys.argv, "--go-on" in sys.argv), ckpt_path=resume)


if __name__ == "__main__":
    main()
