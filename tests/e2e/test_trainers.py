"""trainers/train_classifier.py, the README's main job, run as a user runs it.

The script runs under ``torchrun --standalone --nproc-per-node=2`` (subprocesses,
a tiny generated image set: 32 JPEGs of 2 classes, 16-pixel crops, batches of 4,
so 4 steps per epoch and 8 over 2 epochs). ``trainers/train_sd.py`` has its own
module (tests/test_train_sd.py).

- ``fresh``: 2 ranks stop at ``--max-steps 3``, a checkpoint every 2 steps: the
  checkpoint is step 2, mid-epoch 0, with the loader's consumed ledger.
- ``resumed``: ``--resume`` from that checkpoint continues at step 2 and finishes
  both epochs (step 8; 6 steps of 2 x 4 samples).
- ``nothing_left``: ``--resume`` from the end of training (step 8, the loader's
  state already in epoch 2): no step to do, the summary still prints (it used to
  fail on an unbound ``loss``).
- ``at_max_steps``: ``--resume --max-steps 2`` from the step-2 checkpoint: no step
  (it used to train one more step past the limit). One process.
- ``torch_fresh``/``torch_resumed``: torch's DataLoader (one process, no workers):
  a checkpoint on epoch 0's last step resumes in epoch 1 (it used to train epoch 0
  again).

Runs that do not depend on each other go side by side.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "trainers" / "train_classifier.py"
RUN_TIMEOUT_S = 300
IMAGES, CLASSES, SIZE, BATCH, EPOCHS = 32, 2, 16, 4, 2
STEPS_PER_EPOCH = IMAGES // BATCH // 2  # per rank, 2 ranks
DATA = ["--images", IMAGES, "--classes", CLASSES, "--size", SIZE, "--batch-size", BATCH, "--epochs", EPOCHS,
        "--seed", 1]
COMMON = [*DATA, "--workers", 1, "--ckpt-every", 2]
# torch's DataLoader in one process, no workers: every batch of the 32 images each epoch
TORCH = [*DATA, "--loader", "torch", "--workers", 0, "--ckpt-every", 2 * STEPS_PER_EPOCH]
SUMMARY = re.compile(r"trained (\d+) steps, (\d+) samples in [\d.]+s \(\d+ samples/s\), "
                     r"(?:last loss ([-\d.naif]+)|no step left to train)")
RESUMED = re.compile(r"resumed at step (\d+), epoch (\d+)")


class Run:
    """A launched run of the trainer (its own checkpoint folder), finished by :meth:`finish`."""

    def __init__(self, root: Path, name: str, args: list, nproc: int = 2, ckpt_from: Optional[Path] = None) -> None:
        self.name, self.nproc = name, nproc
        self.dir = root / name
        self.ckpt = self.dir / "ckpt"
        self.ckpt.mkdir(parents=True)
        if ckpt_from is not None:
            shutil.copy(ckpt_from, self.ckpt / "last.pt")
        script = [str(SCRIPT), "--data", str(root / "data"), "--ckpt-dir", str(self.ckpt), *map(str, args)]
        if nproc > 1:
            self.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        *script]
        else:
            self.cmd = [sys.executable, *script]
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # each run starts its own embedded Ray
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.log = self.dir / "output.txt"
        self.t0 = time.monotonic()
        with open(self.log, "w") as out:  # a file, not a pipe: nothing blocks on a full pipe
            self.proc = subprocess.Popen(self.cmd, cwd=self.dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.output = ""
        self.seconds = 0.0

    def finish(self) -> "Run":
        try:
            self.proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.seconds = time.monotonic() - self.t0
        self.output = self.log.read_text(errors="replace")
        return self

    def check_ok(self) -> None:
        assert self.proc.returncode == 0, (f"run {self.name} ({' '.join(self.cmd[1:])}) exited "
                                           f"{self.proc.returncode} after {self.seconds:.0f}s:\n{self.output[-4000:]}")

    def summary(self) -> tuple:
        """(steps, samples, last loss or None) of the final line, printed once (rank 0 only)."""
        self.check_ok()
        found = SUMMARY.findall(self.output)
        assert len(found) == 1, f"run {self.name}: expected one summary line, found {found}:\n{self.output[-3000:]}"
        steps, samples, loss = found[0]
        return int(steps), int(samples), float(loss) if loss else None

    def resumed(self) -> tuple:
        found = RESUMED.findall(self.output)
        assert len(found) == 1, f"run {self.name}: expected one 'resumed at' line, found {found}:\n" \
                                f"{self.output[-3000:]}"
        return int(found[0][0]), int(found[0][1])

    def checkpoint(self) -> dict:
        path = self.ckpt / "last.pt"
        assert path.exists(), f"run {self.name} wrote no checkpoint: {sorted(self.ckpt.iterdir())}"
        return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from sbloader.datagen import write_jpeg_folder

    root = tmp_path_factory.mktemp("train_classifier")
    write_jpeg_folder(str(root / "data"), IMAGES, num_classes=CLASSES, min_size=(48, 48), max_size=(64, 64))
    t0 = time.monotonic()
    done: dict = {}
    fresh = Run(root, "fresh", [*COMMON, "--max-steps", 3])
    torch_fresh = Run(root, "torch_fresh", [*TORCH, "--max-steps", 2 * STEPS_PER_EPOCH], nproc=1)
    done["torch_fresh"] = torch_fresh.finish()
    done["torch_fresh"].check_ok()
    torch_resumed = Run(root, "torch_resumed", [*TORCH, "--resume"], nproc=1, ckpt_from=torch_fresh.ckpt / "last.pt")
    done["fresh"] = fresh.finish()
    done["fresh"].check_ok()
    # snapshot the fresh checkpoint: the resumed runs write their own
    step2 = root / "fresh_step2.pt"
    shutil.copy(fresh.ckpt / "last.pt", step2)
    resumed = Run(root, "resumed", [*COMMON, "--resume"], ckpt_from=step2)
    at_max = Run(root, "at_max_steps", [*COMMON, "--resume", "--max-steps", 2], nproc=1, ckpt_from=step2)
    done["torch_resumed"] = torch_resumed.finish()
    done["at_max_steps"] = at_max.finish()
    done["resumed"] = resumed.finish()
    done["resumed"].check_ok()
    done["nothing_left"] = Run(root, "nothing_left", [*COMMON, "--resume"], ckpt_from=resumed.ckpt / "last.pt").finish()
    took = ", ".join(f"{n} {r.seconds:.1f}s" for n, r in done.items())
    print(f"train_classifier runs took {time.monotonic() - t0:.1f}s: {took}")
    return done


def test_fresh_run_trains_and_prints_its_summary(runs):
    run = runs["fresh"]
    steps, samples, loss = run.summary()
    assert (steps, samples) == (3, 3 * BATCH * 2), run.output[-3000:]
    assert loss is not None and math.isfinite(loss) and loss > 0, loss
    assert not RESUMED.search(run.output), "a fresh run resumed"
    assert "loader (rank 0, last epoch): 3 batches" in run.output, run.output[-3000:]


def test_checkpoint_holds_model_optimiser_and_the_loaders_state(runs):
    from sbloader.core import ledger

    ckpt = runs["fresh"].checkpoint()
    assert (ckpt["step"], ckpt["epoch"]) == (2, 0), {k: ckpt[k] for k in ("step", "epoch")}
    assert ckpt["model"] and ckpt["opt"]["state"], "no model or optimiser state"
    state = ckpt["loader"]
    assert isinstance(state, dict), f"no loader state in the checkpoint: {type(state)}"
    assert state["epoch"] == 0 and state["world_size"] == 2, state
    # the consumed ledger: both ranks' first 2 batches of 4 rows, nothing prefetched
    assert ledger.count(ledger.merge([tuple(r) for r in state["consumed"]])) == 2 * 2 * BATCH, state["consumed"]


def test_resume_continues_from_the_checkpoint_step_and_finishes(runs):
    run = runs["resumed"]
    assert run.resumed() == (2, 0)
    steps, samples, loss = run.summary()
    total = EPOCHS * STEPS_PER_EPOCH
    assert (steps, samples) == (total, (total - 2) * BATCH * 2), run.output[-3000:]
    assert loss is not None and math.isfinite(loss), loss
    ckpt = run.checkpoint()
    # the last step is an epoch's last: the loader's state is that epoch's empty remainder
    # (torchdata's StatefulDataLoader convention), from which the next epoch starts cleanly
    assert (ckpt["step"], ckpt["epoch"]) == (total, EPOCHS - 1)
    assert ckpt["loader"]["epoch"] == EPOCHS - 1 and ckpt["loader"]["empty_remainder"], ckpt["loader"]


def test_resume_with_nothing_left_to_train_still_summarises(runs):
    run = runs["nothing_left"]
    assert run.resumed() == (EPOCHS * STEPS_PER_EPOCH, EPOCHS)
    assert run.summary() == (EPOCHS * STEPS_PER_EPOCH, 0, None)
    assert "no step left to train" in run.output
    assert "UnboundLocalError" not in run.output and "Traceback" not in run.output, run.output[-3000:]


def test_resume_at_max_steps_trains_no_further(runs):
    run = runs["at_max_steps"]
    assert run.resumed() == (2, 0)
    assert run.summary() == (2, 0, None), run.output[-3000:]


def test_torch_loader_resume_after_an_epochs_last_step_starts_the_next_epoch(runs):
    fresh, resumed = runs["torch_fresh"], runs["torch_resumed"]
    per_epoch = 2 * STEPS_PER_EPOCH  # one process: every batch of the 32 images
    steps, samples, _ = fresh.summary()
    assert (steps, samples) == (per_epoch, per_epoch * BATCH)
    ckpt = fresh.checkpoint()
    assert (ckpt["step"], ckpt["epoch"], ckpt["loader"]) == (per_epoch, 0, None)
    assert resumed.resumed() == (per_epoch, 1)
    steps, samples, loss = resumed.summary()
    assert (steps, samples) == (2 * per_epoch, per_epoch * BATCH), resumed.output[-3000:]
    assert loss is not None and math.isfinite(loss)
