"""The drop-in under the trainers people use, each launched as its users launch it.

PyTorch Lightning's ``Trainer`` with ``strategy="ddp"`` (its launcher starts rank 1
as a child process of rank 0, with no ``RANK`` in its environment), ``"ddp_spawn"``
(ranks started by multiprocessing's spawn) and one device; a mid-epoch resume
through Lightning's own checkpoint, on the same and on a different device count.
Every sample once per epoch across ranks, equal counts, and a timeout that turns
a hang into a failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the test extra installs lightning")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "lightning_job.py"
N = 96
ENV = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SBLOADER_JOB_ID")}
ENV["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _lightning(out: Path, strategy: str, devices: int, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), strategy, str(devices), *args], env=ENV,
                          capture_output=True, text=True, timeout=420, cwd=str(out))
    assert proc.returncode == 0, f"lightning {strategy} x{devices} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"


def _seen(out: Path, ranks: int, suffix: str = "") -> list[dict]:
    return [json.loads((out / f"rank{r}{suffix}.json").read_text()) for r in range(ranks)]


def test_lightning_ddp_spawn_two_ranks_every_sample_once_per_epoch(tmp_path):
    """``strategy="ddp_spawn"``, uninterrupted. The same checks for ``"ddp"`` are made on the 2-device
    resumed run's whole epoch 1 (``test_lightning_mid_epoch_resume...[2]``): one launch fewer."""
    _lightning(tmp_path, "ddp_spawn", 2)
    ranks = _seen(tmp_path, 2)
    for epoch in ("0", "1"):
        assert len(ranks[0][epoch]) == len(ranks[1][epoch]) == N // 2
        assert sorted(ranks[0][epoch] + ranks[1][epoch]) == list(range(N))
    assert ranks[0]["0"] != ranks[0]["1"], "shuffle=True: another order each epoch"


@pytest.fixture(scope="module")
def stopped_at_step_2(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One ddp run on 2 devices stopped at step 2 of epoch 0 (a checkpoint, then a hard exit), shared by
    the resumes below (each resumes into a folder of its own): its folder and what each rank saw."""
    out = tmp_path_factory.mktemp("lightning_stopped")
    _lightning(out, "ddp", 2, "--stop-at", "2")
    return out, _seen(out, 2)


@pytest.mark.parametrize("resume_devices", [2, 1])
def test_lightning_mid_epoch_resume_through_its_checkpoint_is_exactly_once(tmp_path, stopped_at_step_2,
                                                                           resume_devices):
    """Stop at step 2 of epoch 0 on 2 devices (a checkpoint, then a hard exit); ``fit(ckpt_path=...)``
    on ``resume_devices``: Lightning restores the loader's state, the rest of epoch 0 comes exactly
    once, then a whole epoch 1."""
    stopped, before = stopped_at_step_2
    _lightning(tmp_path, "ddp", resume_devices, "--resume", str(stopped / "mid.ckpt"))
    after = _seen(tmp_path, resume_devices, "-resumed")
    epoch0 = [i for r in before + after for i in r.get("0", [])]
    assert sorted(epoch0) == list(range(N)), "epoch 0 across the preemption: every sample exactly once"
    epoch1 = [i for r in after for i in r["1"]]
    assert sorted(epoch1) == list(range(N))
    if resume_devices == 2:  # "ddp" on 2 ranks, a whole epoch: equal counts, and another order than epoch 0's
        assert len(after[0]["1"]) == len(after[1]["1"]) == N // 2
        assert before[0]["0"] + after[0]["0"] != after[0]["1"], "shuffle=True: another order each epoch"


def _accelerate(out: Path, processes: int, *args: str) -> None:
    pytest.importorskip("accelerate")
    script = SCRIPT.parent / "accelerate_job.py"
    multi = ["--multi_gpu"] if processes > 1 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *multi, "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(out), *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=420, cwd=str(out))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def accelerate_on_two(tmp_path_factory) -> Path:
    """One ``accelerate launch`` of 2 processes for both accelerate tests (one launch and its Ray instead of
    two): the plain loader's two epochs (``rank{R}-plain.json``), then in the same processes the mixture
    stopped at step 2 of epoch 0 (``save_state``, then a hard exit; ``rank{R}.json``). Its folder."""
    out = tmp_path_factory.mktemp("accelerate")
    _accelerate(out, 2, "--plain-first", "--mix", "--stop-at", "2")
    return out


def test_accelerate_launch_two_processes_through_prepare(accelerate_on_two):
    """``accelerate launch --multi_gpu --num_processes 2`` (torchrun's static rendezvous underneath, run id
    "none") with ``accelerator.prepare(loader)`` on the CPU: every sample once per epoch, equal counts."""
    ranks = [json.loads((accelerate_on_two / f"rank{r}-plain.json").read_text()) for r in range(2)]
    assert ranks[0]["type"] == "DataLoader"  # prepare() leaves sbloader's loader as it is
    for e in range(2):
        assert len(ranks[0]["epochs"][e]) == len(ranks[1]["epochs"][e]) == 48
        assert sorted(ranks[0]["epochs"][e] + ranks[1]["epochs"][e]) == list(range(96))


def _each_source_epoch_once(stream: list, sources: tuple = ((0, 60), (1000, 30))) -> None:
    """Per source of the mixture jobs, the ids in the order read: every run of its size is one whole
    epoch of it (the last, short, has no repeats); ``stream`` starts with the ranks' rows before a
    preemption, which lie in each source's first epoch."""
    from harness import each_source_epoch_once

    for offset, n in sources:
        ids = [i for i in stream if offset <= i < offset + n]
        assert len(ids) > 2 * n  # the source ran past its first epoch boundaries
        each_source_epoch_once(ids, n, offset)


def test_accelerate_mixture_saved_on_two_processes_resumes_on_one_through_save_and_load_state(accelerate_on_two,
                                                                                              tmp_path):
    """A mixture registered with ``accelerator.register_for_checkpointing``: ``save_state`` at step 2 of
    epoch 0 on 2 processes (a hard exit after it), ``load_state`` on 1: the ranks were partway
    through their sources' batches, and every source's epochs are read whole, each sample once."""
    stopped = accelerate_on_two
    before = [json.loads((stopped / f"rank{r}.json").read_text())["epochs"] for r in range(2)]
    assert all(len(b) == 1 and len(b[0]) == 24 for b in before)
    _accelerate(tmp_path, 1, "--mix", "--resume", str(stopped / "ckpt"))
    after = json.loads((tmp_path / "rank0-resumed.json").read_text())
    assert after["type"] == "MixDataLoader" and [len(e) for e in after["epochs"]] == [N - 24, N]
    _each_source_epoch_once(before[0][0] + before[1][0] + after["epochs"][0] + after["epochs"][1])


@pytest.fixture(scope="module")
def mixture_runs(tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    """``sbloader.mix`` of two sources under Lightning on 2 devices (``num_samples`` per rank), one run
    that saves its checkpoint at step 2 of epoch 0 and what each rank had seen by then, then trains on
    uninterrupted (``--go-on``): the uninterrupted run and the stopped one in one launch instead of two
    (the checkpoint file is what a run stopped there leaves; a resume is a new process either way, and
    the hard exit after a checkpoint is kept by ``stopped_at_step_2``)."""
    run = tmp_path_factory.mktemp("mix_whole_and_stopped")
    _lightning(run, "ddp", 2, "--mix", "--stop-at", "2", "--go-on")
    return _seen(run, 2), _seen(run, 2, "-stopped"), run


@pytest.mark.parametrize("resume_devices", [2, 1])
def test_lightning_mixture_resumed_through_its_checkpoint_repeats_the_uninterrupted_epochs(tmp_path, mixture_runs,
                                                                                           resume_devices):
    """Resumed through Lightning's checkpoint on ``resume_devices``. On 2 devices the rest of epoch 0
    draws the samples the uninterrupted run drew (the schedule is the seed's), none twice and none
    lost across the preemption, then the same epoch 1. On 1 device (the checkpoint was taken while
    the ranks were partway through their sources' batches: each source's loader credits the rows
    the two ranks had used) every source's epochs are read whole, each sample once per epoch, and
    each epoch of the mixture has its ``num_samples``."""
    full, before, stopped = mixture_runs
    _lightning(tmp_path, "ddp", resume_devices, "--mix", "--resume", str(stopped / "mid.ckpt"))
    after = _seen(tmp_path, resume_devices, "-resumed")
    expected = sorted(i for r in full for i in r["0"])
    assert len(expected) == 2 * N and any(i >= 1000 for i in expected) and any(i < 1000 for i in expected)
    got = sorted(i for r in before + after for i in r.get("0", []))
    if resume_devices == 1:
        assert len(after[0]["0"]) == N - len(before[0]["0"])
        _each_source_epoch_once([i for r in before for i in r["0"]] + after[0]["0"] + after[0]["1"])
    else:
        lost, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        assert got == expected, f"epoch 0: lost {lost}, extra {extra}"
    epoch1 = sorted(i for r in after for i in r["1"])
    if resume_devices == 2:
        assert epoch1 == sorted(i for r in full for i in r["1"])
    assert len(epoch1) == N * resume_devices
