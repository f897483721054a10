"""trainers/train_sd.py: the Stable-Diffusion-style trainer on both loaders.

The end-to-end tests run the script as a user would (subprocesses, tiny sizes):
sbloader in one process, torch's DataLoader in one process, sbloader under a
2-rank torchrun, and a resume of each single-process run from its step-2
checkpoint. Independent runs go side by side to keep the module short. Each run
writes per-rank metrics (losses, batch ids, the shapes of the latents and text
embeddings the trainer received, the encoder pids behind its batches, the pool's
actor counts) and the encoders append one line per construction to a log.

The unit tests at the bottom check the script's pieces in-process (no Ray), from the
package ``trainers/sd`` they live in, and that ``import train_sd`` still gives them.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "trainers" / "train_sd.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_sd  # noqa: E402
from sd.checkpoints import checkpoint_files, latest_checkpoint, write_checkpoint  # noqa: E402
from sd.cli import parse_args  # noqa: E402
from sd.data import BOS, EpochSampler, ParquetCaptionDataset, dataset_path, tokenize, write_dataset  # noqa: E402
from sd.denoiser import DDPM, TinyUNet, step_generator  # noqa: E402
from sd.encoders import SDEncoders  # noqa: E402

RUN_TIMEOUT_S = 240
IMAGES, SIZE, GROUP, BATCH, STEPS = 32, 32, 8, 4, 4
COMMON = ["--images", IMAGES, "--size", SIZE, "--rows-per-group", GROUP, "--batch-size", BATCH,
          "--encode-batch", 4, "--ckpt-every", 2, "--seed", 3]
LATENTS = [BATCH, 4, SIZE // 8, SIZE // 8]
TEXT_EMB = [BATCH, 16, 64]


@dataclass
class Run:
    """One finished run: its output, metrics per rank and encoder-construction log."""

    name: str
    output: str
    metrics: list
    constructions: list
    ckpt_dir: Path
    seconds: float


class Started:
    """A launched run, finished by :meth:`finish`."""

    def __init__(self, root: Path, name: str, args: list, nproc: int = 1, ckpt_from: Optional[Path] = None) -> None:
        self.name, self.nproc = name, nproc
        self.dir = root / name
        self.ckpt_dir = self.dir / "ckpt"
        self.ckpt_dir.mkdir(parents=True)
        if ckpt_from is not None:  # resume from that checkpoint only
            shutil.copy(ckpt_from, self.ckpt_dir / ckpt_from.name)
        self.log = self.dir / "encoders.jsonl"
        self.metrics = self.dir / "metrics"
        script = [str(SCRIPT), "--data", str(root / "data"), "--ckpt-dir", str(self.ckpt_dir),
                  "--encoder-log", str(self.log), "--metrics-dir", str(self.metrics), *[str(a) for a in args]]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
        else:
            cmd = [sys.executable, *script]
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # each run starts its own embedded Ray
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.cmd = cmd
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=self.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)

    def finish(self, expect_ok: bool = True) -> Run:
        try:
            output, _ = self.proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            output, _ = self.proc.communicate()
            pytest.fail(f"run {self.name} did not finish in {RUN_TIMEOUT_S}s; output tail:\n{output[-4000:]}")
        if expect_ok:
            assert self.proc.returncode == 0, \
                f"run {self.name} ({' '.join(self.cmd[1:])}) exited {self.proc.returncode}:\n{output[-4000:]}"
        else:
            assert self.proc.returncode != 0, f"run {self.name} should have failed:\n{output[-4000:]}"
        metrics = []
        if expect_ok:
            for r in range(self.nproc):
                path = self.metrics / f"rank{r}.json"
                assert path.exists(), f"run {self.name}: rank {r} wrote no metrics:\n{output[-4000:]}"
                metrics.append(json.loads(path.read_text()))
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return Run(self.name, output, metrics, [json.loads(x) for x in lines], self.ckpt_dir,
                   time.monotonic() - self.t0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("train_sd")
    # Write the Parquet once, before the runs share it.
    args = parse_args([*map(str, COMMON), "--data", str(root / "data")])
    write_dataset(dataset_path(args), args)
    t0 = time.monotonic()
    started = {
        # One encoder actor at most: constructions must equal the pool's actors exactly.
        "sbloader": Started(root, "sbloader", [*COMMON, "--steps", STEPS, "--encoder-actors", 1]),
        "torch": Started(root, "torch", [*COMMON, "--steps", STEPS, "--loader", "torch", "--workers", 1]),
        # Two ranks, 3 steps of 4 each, one encoder actor: were the pool per rank, there would be two.
        "torchrun": Started(root, "torchrun", [*COMMON, "--steps", 3, "--encoder-actors", 1], nproc=2),
    }
    # The same rows from img2dataset-style WebDataset shards (2 shards of 16).
    started["webdataset"] = Started(root, "webdataset", [*COMMON, "--steps", STEPS, "--encoder-actors", 1,
                                                         "--format", "webdataset", "--samples-per-shard", 16])
    done = {"torch": started.pop("torch").finish()}  # the quickest: its resumes start first
    torch_ckpt = done["torch"].ckpt_dir / "step_00000002.pt"
    started["torch_resume"] = Started(root, "torch_resume", [*COMMON, "--steps", STEPS, "--loader", "torch",
                                                             "--workers", 1, "--resume"], ckpt_from=torch_ckpt)
    started["wrong_loader"] = Started(root, "wrong_loader", [*COMMON, "--steps", STEPS, "--resume"],
                                      ckpt_from=torch_ckpt)
    done["sbloader"] = started.pop("sbloader").finish()
    started["sbloader_resume"] = Started(root, "sbloader_resume", [*COMMON, "--steps", STEPS, "--encoder-actors", 1,
                                                                   "--resume"],
                                         ckpt_from=done["sbloader"].ckpt_dir / "step_00000002.pt")
    done.update({name: st.finish(expect_ok=name != "wrong_loader") for name, st in started.items()})
    took = ", ".join(f"{n} {r.seconds:.1f}s" for n, r in done.items())
    print(f"train_sd runs took {time.monotonic() - t0:.1f}s: {took}")
    return done


def check_received(run: Run, rank: int = 0) -> dict:
    """The trainer got encoded batches of the expected shapes and trained on them."""
    m = run.metrics[rank]
    assert m["shapes"] == {"latents": {"shape": LATENTS, "dtype": "torch.float32"},
                           "text_emb": {"shape": TEXT_EMB, "dtype": "torch.float32"},
                           "text_mask": {"shape": TEXT_EMB[:2], "dtype": "torch.bool"}}, \
        f"{run.name} rank {rank}: the trainer received {m['shapes']}"
    assert all(math.isfinite(v) for v in m["losses"].values()), f"{run.name}: losses {m['losses']}"
    for step, ids in m["ids"].items():
        assert len(ids) == BATCH and all(0 <= i < IMAGES for i in ids), f"{run.name} step {step}: ids {ids}"
    return m


def check_summary_printed(run: Run, world: int) -> None:
    out = run.output
    assert "samples/s" in out and f"on {world} rank(s)" in out, f"{run.name}: no throughput line:\n{out[-3000:]}"
    assert "stall fraction" in out, f"{run.name}: no stall fraction line:\n{out[-3000:]}"


# ----- end to end ---------------------------------------------------------------------


def test_sbloader_trains_on_the_pipelines_latents_and_text_embeddings(runs):
    run = runs["sbloader"]
    m = check_received(run)
    assert (m["start_step"], m["step"], m["steps_run"]) == (0, STEPS, STEPS), m
    ids = [i for step in sorted(m["ids"], key=int) for i in m["ids"][step]]
    assert len(set(ids)) == len(ids) == STEPS * BATCH, f"a row came twice within the epoch: {ids}"
    check_summary_printed(run, 1)
    assert sorted(p.name for p in run.ckpt_dir.iterdir()) == ["step_00000002.pt", "step_00000004.pt"]
    state = torch.load(run.ckpt_dir / "step_00000004.pt", weights_only=False)["loader_state"]
    assert state["kind"] == "sbloader" and state["loader"]["format"] == "sbloader.PipelineLoader", state
    json.dumps(state)  # the loader state is plain data


def test_encoder_pool_constructed_once_per_actor(runs):
    run = runs["sbloader"]
    m = run.metrics[0]
    actors = m["loader_summary"]["actors_created"]
    cons = run.constructions
    assert [c["where"] for c in cons] == ["actor"] * len(cons), cons
    # concurrency=(1, 1): the pool's one actor, constructed exactly once, encoded every batch.
    assert actors == 1 and len(cons) == 1, f"{actors} pool actors, {len(cons)} constructions: {cons}"
    assert m["encoder_pids"] == [cons[0]["pid"]], f"batches came from {m['encoder_pids']}, actor {cons[0]}"
    tasks = sum(e["encoder_tasks"] for e in m["loader_summary"]["epochs"])
    assert tasks >= 2, f"the actor encoded {tasks} block(s); expected several calls on one construction"


def test_torch_baseline_runs_the_same_encoders_in_the_trainer(runs):
    run, pipe = runs["torch"], runs["sbloader"]
    m = check_received(run)
    assert (m["start_step"], m["step"]) == (0, STEPS), m
    assert m["encode_in_trainer_s"] > 0, "the baseline did not time its in-trainer encoding"
    check_summary_printed(run, 1)
    assert len(run.constructions) == 1 and run.constructions[0]["where"] == "trainer", run.constructions
    assert m["encoder_pids"] == [run.constructions[0]["pid"]]
    # The same fixed seed builds the same weights in the trainer as in the pool's actors.
    assert run.constructions[0]["checksum"] == pipe.constructions[0]["checksum"], \
        (run.constructions[0], pipe.constructions[0])


def test_torchrun_two_ranks_with_sbloader(runs):
    run = runs["torchrun"]
    assert len(run.metrics) == 2
    for r in range(2):
        m = check_received(run, r)
        assert (m["world"], m["step"], m["steps_run"]) == (2, 3, 3), m
    check_summary_printed(run, 2)
    ids = [set(i for v in run.metrics[r]["ids"].values() for i in v) for r in range(2)]
    assert not ids[0] & ids[1], f"ranks trained on the same rows: {sorted(ids[0] & ids[1])}"
    # The job runs one pipeline (on its split coordinator) with one pool of (1, 1) actors for
    # both ranks: one actor launched, constructed once, and every batch of both ranks from it.
    cons = run.constructions
    actors = [(m["loader_summary"]["actors_created"], m["loader_summary"]["actors_ready"]) for m in run.metrics]
    assert actors == [(1, 1), (1, 1)], f"(launched, ready) actors per rank: {actors}"
    assert len(cons) == 1, f"one pool for both ranks constructs its one actor once: {cons}"
    used = [m["encoder_pids"] for m in run.metrics]
    assert used == [[cons[0]["pid"]]] * 2, f"encoder pids per rank {used}, the actor {cons[0]}"
    # The step-2 checkpoint's loader state gathered both ranks' ledgers: 2 steps x 4 rows x 2 ranks.
    state = torch.load(run.ckpt_dir / "step_00000002.pt", weights_only=False)["loader_state"]["loader"]
    consumed = sum(GROUP * (b - a) for a, b in state["done"]) + sum(state["partial"].values())
    assert consumed == 2 * BATCH * 2, f"the checkpoint records {consumed} consumed rows: {state}"


@pytest.mark.parametrize("loader", ["sbloader", "torch"])
def test_resume_continues_at_the_saved_step(runs, loader):
    full, resumed = runs[loader], runs[f"{loader}_resume"]
    m, ref = check_received(resumed), full.metrics[0]
    assert "at step 2" in resumed.output, resumed.output[-3000:]
    assert (m["start_step"], m["step"], m["steps_run"]) == (2, STEPS, STEPS - 2), m
    assert sorted(m["losses"], key=int) == ["3", "4"], m["losses"]
    # Same rows and (deterministic delivery, seeded noise) the same losses as the uninterrupted run.
    for step in ("3", "4"):
        assert m["ids"][step] == ref["ids"][step], f"step {step}: resumed ids {m['ids'][step]} vs {ref['ids'][step]}"
        assert m["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-5, abs=1e-7), (step, m, ref)


def test_resume_with_the_other_loader_is_a_clear_error(runs):
    out = runs["wrong_loader"].output
    assert "was written with --loader torch, found --loader sbloader" in out, out[-3000:]


# ----- the pieces, in-process ----------------------------------------------------------


def test_webdataset_shards_train_on_the_same_batches_as_the_parquet_file(runs):
    # Shards of 16 cut into ranges of 8 are the Parquet file's row groups of 8: the same
    # partitions, the same plan, the same augmentations, so the same batches and losses.
    wds, pq_run = runs["webdataset"], runs["sbloader"]
    m = check_received(wds)
    assert (m["start_step"], m["step"]) == (0, STEPS), m
    assert m["ids"] == pq_run.metrics[0]["ids"], (m["ids"], pq_run.metrics[0]["ids"])
    assert m["losses"] == pq_run.metrics[0]["losses"]
    shards = sorted(p.name for p in next((wds.ckpt_dir.parent.parent / "data").glob("*-wds")).iterdir())
    assert shards == ["00000.parquet", "00000.tar", "00000_stats.json", "00001.parquet", "00001.tar",
                      "00001_stats.json"], shards


def test_webdataset_keys_give_the_row_back_and_the_torch_baseline_refuses_shards():
    from sbloader.datagen import img2dataset_key

    for sps in (16, 100, 10000):
        for row in (0, 5, sps - 1, sps, 3 * sps + 7):
            assert train_sd.webdataset_id(img2dataset_key(row // sps, row % sps, sps), sps) == row
    assert img2dataset_key(0, 0, 10000) == "000000000"
    with pytest.raises(SystemExit):
        parse_args(["--format", "webdataset", "--loader", "torch"])


def test_tokenize_is_deterministic_padded_and_truncated():
    toks = tokenize(["red cat", "", "a b c d e f g h"], max_tokens=5, vocab=50)
    assert toks.shape == (3, 5) and toks.dtype == np.int64
    assert list(toks[:, 0]) == [BOS] * 3
    assert list(toks[0, 3:]) == [0, 0] and list(toks[1, 1:]) == [0] * 4
    words = toks[:, 1:][toks[:, 1:] != 0]
    assert (toks[2] != 0).all() and toks.max() < 50 and (words >= 2).all()
    assert np.array_equal(toks, tokenize(["red cat", "", "a b c d e f g h"], 5, 50))
    assert np.array_equal(tokenize(["Red CAT"], 5, 50), toks[:1])


def test_epoch_sampler_splits_like_distributed_sampler_and_skips():
    samplers = [EpochSampler(23, r, 3, seed=5) for r in range(3)]
    keys = [list(s) for s in samplers]
    assert [len(k) for k in keys] == [7, 7, 7] == [len(s) for s in samplers]
    flat = [i for k in keys for _, i in k]
    assert len(set(flat)) == 21 and all(e == 0 for k in keys for e, _ in k)
    s = samplers[1]
    s.set_epoch(0, skip=4)
    assert list(s) == keys[1][4:] and len(s) == 3
    s.set_epoch(1)
    assert [i for _, i in s] != [i for _, i in keys[1]] and {e for e, _ in s} == {1}


def test_encoders_identical_per_construction_and_logged(tmp_path):
    log = tmp_path / "log.jsonl"
    a = SDEncoders(vocab=100, max_tokens=8, text_dim=32, seed=7, log_path=str(log))
    b = SDEncoders(vocab=100, max_tokens=8, text_dim=32, seed=7, log_path=str(log))
    c = SDEncoders(vocab=100, max_tokens=8, text_dim=32, seed=8)
    assert a.checksum == b.checksum != c.checksum
    rng = np.random.default_rng(0)
    batch = {"id": np.arange(3), "image": rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8),
             "tokens": tokenize(["red cat", "blue", "a tree by a river"], 8, 100)}
    batch["image"].flags.writeable = False  # as from the object store
    oa, ob = a(batch), b(batch)
    assert oa["latents"].shape == (3, 4, 4, 4) and oa["latents"].dtype == np.float32
    assert oa["text_emb"].shape == (3, 8, 32) and oa["text_mask"].dtype == bool
    assert list(oa["text_mask"].sum(1)) == [3, 2, 6]
    assert not oa["text_emb"][1, 2:].any(), "padding positions carry embeddings"
    for k in ("latents", "text_emb", "text_mask", "id"):
        assert np.array_equal(oa[k], ob[k]), k
    assert list(oa["encoder_pid"]) == [os.getpid()] * 3
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 2 and {x["checksum"] for x in lines} == {a.checksum}


def test_parquet_caption_dataset_augments_per_epoch_and_index(tmp_path):
    args = parse_args(["--images", "12", "--size", "32", "--rows-per-group", "5", "--data", str(tmp_path)])
    path = write_dataset(dataset_path(args), args)
    ds = ParquetCaptionDataset(path, 32, 16, 4096, seed=1, cache_row_groups=1)
    assert len(ds) == 12
    x = ds[(0, 7)]
    assert x["id"] == 7 and x["image"].shape == (3, 32, 32) and x["image"].dtype == torch.uint8
    assert x["tokens"].shape == (16,) and x["tokens"][0] == BOS
    ds[(0, 0)], ds[(0, 11)]  # evict row group 1 from the one-slot cache
    assert torch.equal(ds[(0, 7)]["image"], x["image"]), "the same key gave another augmentation"
    assert any(not torch.equal(ds[(e, 7)]["image"], x["image"]) for e in range(1, 6)), "epochs share their crops"
    with pytest.raises(IndexError, match="out of range"):
        ds[(0, 12)]


def test_unet_ddpm_loss_trains_every_parameter():
    torch.manual_seed(0)
    model = TinyUNet(base=16, text_dim=32)
    ddpm = DDPM(steps=100)
    x0 = torch.randn(3, 4, 4, 4)
    ctx = torch.randn(3, 8, 32)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, :3] = True
    g = step_generator(0, 0, 0, torch.device("cpu"))
    loss = ddpm.loss(model, x0, ctx, mask, g, cond_drop=0.5)
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters()), "a parameter is unused (DDP would complain)"
    assert model(x0, torch.tensor([0, 5, 99]), ctx, mask).shape == x0.shape
    g1, g2 = (step_generator(0, 0, 7, torch.device("cpu")) for _ in range(2))
    assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))


def test_checkpoints_keep_the_newest(tmp_path):
    for step in (2, 4, 6, 8):
        write_checkpoint(str(tmp_path), step, keep=2, model={}, opt={}, loader_state={"kind": "torch"})
    assert [s for s, _ in checkpoint_files(str(tmp_path))] == [6, 8]
    args = parse_args(["--ckpt-dir", str(tmp_path), "--loader", "sbloader"])
    with pytest.raises(ValueError, match="written with --loader torch"):
        latest_checkpoint(args)
    args = parse_args(["--ckpt-dir", str(tmp_path / "none")])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        latest_checkpoint(args)


def test_entry_script_reexports_the_package():
    import sd.cli

    assert train_sd.main is sd.cli.main
    for name in train_sd.__all__:
        obj = getattr(train_sd, name)
        assert not callable(obj) or obj.__module__.startswith("sd."), (name, obj)
    assert train_sd.SDEncoders is SDEncoders and train_sd.tokenize is tokenize
