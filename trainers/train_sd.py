"""Train a small Stable-Diffusion-style latent denoiser on generated images and captions.

    python3 trainers/train_sd.py --images 64 --steps 4                 # one process, sbloader
    python3 trainers/train_sd.py --images 64 --steps 4 --loader torch  # torch's DataLoader baseline
    torchrun --standalone --nproc-per-node=2 trainers/train_sd.py --images 64 --steps 4
    python3 trainers/train_sd.py --images 64 --steps 4 --format webdataset  # from img2dataset-style shards
    ... --resume                                                       # continue from the latest checkpoint

The entry script: the trainer lives in the package ``trainers/sd/`` (its docstring, also
``--help``, says what it does; ``sd.data``, ``sd.encoders``, ``sd.denoiser``,
``sd.sources``, ``sd.checkpoints``, ``sd.loop``, ``sd.cli``). This script puts
``trainers/`` on ``sys.path`` and calls :func:`sd.cli.main`.

``import train_sd`` (with ``trainers/`` on ``sys.path``) still gives the trainer's public
names, re-exported from their modules. To replace one (a benchmark's encoders, say), patch it
in the module that looks it up (``sd.sources.SDEncoders``), not here.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sd.checkpoints import CKPT_PREFIX, checkpoint_files, latest_checkpoint, write_checkpoint  # noqa: E402
from sd.cli import main, parse_args, ray_cpus  # noqa: E402
from sd.data import (BOS, PAD, EpochSampler, ParquetCaptionDataset, dataset_path, preprocess,  # noqa: E402
                     preprocess_webdataset, resize_crop_flip, tokenize, webdataset_id, write_dataset)
from sd.denoiser import (DDPM, DOWNSAMPLE, CrossAttention, ResBlock, TinyUNet, step_generator,  # noqa: E402
                         timestep_embedding)
from sd.encoders import SDEncoders, TextEncoder, VAEEncoder, weights_checksum  # noqa: E402
from sd.loop import train  # noqa: E402
from sd.sources import BatchSource, PipelineSource, TorchSource  # noqa: E402

__all__ = [
    "BOS", "CKPT_PREFIX", "DDPM", "DOWNSAMPLE", "PAD", "BatchSource", "CrossAttention", "EpochSampler",
    "ParquetCaptionDataset", "PipelineSource", "ResBlock", "SDEncoders", "TextEncoder", "TinyUNet", "TorchSource",
    "VAEEncoder", "checkpoint_files", "dataset_path", "latest_checkpoint", "main", "parse_args", "preprocess",
    "preprocess_webdataset", "ray_cpus", "resize_crop_flip", "step_generator", "timestep_embedding", "tokenize",
    "train", "webdataset_id", "weights_checksum", "write_checkpoint", "write_dataset",
]

if __name__ == "__main__":
    import ray.cloudpickle

    import sd

    # The pipeline's functions and classes (preprocess, SDEncoders) go to Ray's workers by
    # value, as they did when they lived in this script: a node without trainers/ on its disk
    # runs them too.
    ray.cloudpickle.register_pickle_by_value(sd)
    main()
