"""The two loaders behind one interface: :class:`BatchSource` yields encoded batches to the loop,
from the sbloader pipeline (:class:`PipelineSource`) or torch's DataLoader (:class:`TorchSource`)."""
from __future__ import annotations

import argparse
import time
from typing import Iterator, Optional

import torch

from sd.data import EpochSampler, ParquetCaptionDataset, preprocess, preprocess_webdataset
from sd.encoders import SDEncoders


class BatchSource:
    """Endless encoded batches (dicts with ``latents``, ``text_emb``, ``text_mask``, ``id``, ``encoder_pid``).

    Attributes:
        epoch: the epoch being read.
        encode_s: seconds the trainer process spent encoding (torch baseline only).
    """

    kind = ""
    epoch = 0
    encode_s = 0.0

    def batches(self) -> Iterator[dict]:
        """Batches across epochs, from the loaded position on; closing it stops the loader."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The position of the training loop (every rank must call it at the same step)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (before :meth:`batches`)."""
        raise NotImplementedError

    def summary(self) -> dict:
        """Loader-specific figures for the metrics file."""
        return {}

    def describe_stalls(self) -> Optional[str]:
        """The loader's own stall report, if it has one."""
        return None


class PipelineSource(BatchSource):
    """``--loader sbloader``: read_parquet (or read_webdataset) -> preprocess (CPU tasks) -> SDEncoders (actor
    pool) -> to_dataloader."""

    kind = "sbloader"

    def __init__(self, args: argparse.Namespace, path: str, device: torch.device) -> None:
        import sbloader

        cuda = torch.cuda.is_available()
        encoder_kwargs = dict(vocab=args.vocab, max_tokens=args.max_tokens, text_dim=args.text_dim,
                              seed=args.encoder_seed, log_path=args.encoder_log)
        kw = dict(size=args.size, max_tokens=args.max_tokens, vocab=args.vocab)
        if args.format == "webdataset":  # img2dataset's layout: the jpg and txt of every sample, undecoded
            read = sbloader.read_webdataset(path, decode=False, samples_per_partition=args.rows_per_group)
            fn, kw = preprocess_webdataset, dict(kw, samples_per_shard=args.samples_per_shard)
        else:
            read, fn = sbloader.read_parquet(path, columns=["id", "image", "caption"]), preprocess
        self.dataset = (
            read
            .map_batches(fn, num_cpus=1, fn_kwargs=kw)
            .map_batches(SDEncoders, batch_size=args.encode_batch, concurrency=(1, args.encoder_actors),
                         num_cpus=args.encoder_cpus, num_gpus=args.encoder_gpus if cuda else None,
                         fn_constructor_kwargs=encoder_kwargs)
        )
        self.loader = self.dataset.to_dataloader(
            batch_size=args.batch_size, shuffle=True, seed=args.seed, drop_last=True,
            deterministic=args.deterministic, pin_memory=device.type == "cuda",
            persistent_workers=True,  # the encoders are built once, not once per epoch
            memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None)
        self.epoch_stats: list[dict] = []

    def _record(self) -> None:
        st = self.loader.stats()
        if st is None:
            return
        pool = [o for o in st.operators if "SDEncoders" in o.name]
        self.epoch_stats.append({"epoch": self.epoch, "actors_created": pool[0].actors_created if pool else 0,
                                 "actors_ready": pool[0].actors_ready if pool else 0,
                                 "encoder_tasks": pool[0].tasks if pool else 0})

    def batches(self) -> Iterator[dict]:
        empty = 0  # a resumed epoch that was all consumed gives no batch once; twice in a row is an error
        while True:
            it = iter(self.loader)
            got = 0
            try:
                for batch in it:
                    got += 1
                    yield batch
            finally:
                it.close()
                self._record()
            empty = 0 if got else empty + 1
            if empty > 1:
                raise RuntimeError("two epochs in a row gave no batch: the rows per rank cannot fill --batch-size")
            self.epoch += 1

    def state_dict(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.epoch = int(state["loader"]["epoch"])

    def summary(self) -> dict:
        return {"actors_created": sum(e["actors_created"] for e in self.epoch_stats),
                "actors_ready": sum(e["actors_ready"] for e in self.epoch_stats), "epochs": self.epoch_stats}

    def describe_stalls(self) -> Optional[str]:
        s = self.loader.stall_stats()
        return f"sbloader's own stall instrument (last epoch): {s}" if s is not None else None


class TorchSource(BatchSource):
    """``--loader torch``: torch's DataLoader (decode/augment in workers) + the encoders in this process."""

    kind = "torch"

    def __init__(self, args: argparse.Namespace, path: str, rank: int, world: int, device: torch.device) -> None:
        from torch.utils.data import DataLoader

        self.dataset = ParquetCaptionDataset(path, args.size, args.max_tokens, args.vocab, args.seed)
        self.sampler = EpochSampler(len(self.dataset), rank, world, args.seed)
        self.world, self.batch_size = world, args.batch_size
        self.loader = DataLoader(self.dataset, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=args.workers, persistent_workers=args.workers > 0,
                                 pin_memory=device.type == "cuda", drop_last=True)
        self.encoders = SDEncoders(vocab=args.vocab, max_tokens=args.max_tokens, text_dim=args.text_dim,
                                   seed=args.encoder_seed, device=str(device), log_path=args.encoder_log,
                                   where="trainer")
        self.batch_in_epoch = 0

    def batches(self) -> Iterator[dict]:
        while True:
            self.sampler.set_epoch(self.epoch, skip=self.batch_in_epoch * self.batch_size)
            got = 0
            for batch in self.loader:
                t0 = time.perf_counter()
                out = self.encoders.encode(batch["image"], batch["tokens"])
                if out["latents"].is_cuda:
                    torch.cuda.synchronize()
                self.encode_s += time.perf_counter() - t0
                out["id"] = batch["id"]
                out["encoder_pid"] = torch.full((len(batch["id"]),), self.encoders.pid, dtype=torch.int64)
                self.batch_in_epoch += 1
                got += 1
                yield out
            if got == 0 and self.batch_in_epoch == 0:
                raise RuntimeError(f"an epoch gave no batch: {len(self.dataset)} rows over {self.world} rank(s) "
                                   f"is below --batch-size {self.batch_size} per rank")
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "world": self.world, "batch_size": self.batch_size, "rows": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("world", self.world), ("batch_size", self.batch_size), ("rows", len(self.dataset))):
            if state.get(key) != mine:
                raise ValueError(f"the torch loader's checkpointed position needs the same {key}: "
                                 f"found {state.get(key)!r}, expected {mine!r} (sbloader resumes on any world size)")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
