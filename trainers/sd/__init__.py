"""Train a small Stable-Diffusion-style latent denoiser on generated images and captions.

    python3 trainers/train_sd.py --images 64 --steps 4                 # one process, sbloader
    python3 trainers/train_sd.py --images 64 --steps 4 --loader torch  # torch's DataLoader baseline
    torchrun --standalone --nproc-per-node=2 trainers/train_sd.py --images 64 --steps 4
    ... --resume                                                       # continue from the latest checkpoint

The data is a Parquet file of JPEG bytes and captions (``sbloader.datagen.write_image_parquet``,
written once per set of parameters). Two loaders feed the same trainer:

``--loader sbloader`` (the pipeline)
    ``read_parquet`` -> ``map_batches(preprocess)`` on CPU tasks (decode, resize the shorter
    side, random crop, flip, tokenize the caption) -> ``map_batches(SDEncoders,
    concurrency=(1, N))``: an actor pool (``num_gpus`` when CUDA is there) that builds a
    small VAE encoder and a small text encoder once per actor, from a fixed seed so every
    actor holds the same weights, and turns each batch into latents ``(4, H/8, W/8)`` and
    text embeddings ``(L, D)`` -> ``to_dataloader`` streams ready batches into each rank
    (per-rank partition split under torchrun, equal batch counts).

``--loader torch`` (the single-node baseline)
    torch's ``DataLoader`` over a map-style Dataset that reads the Parquet rows and
    decodes/augments/tokenizes in ``--workers`` processes; the same encoders run in the
    trainer process on the collated batch.

The denoiser is a small UNet (ResNet blocks conditioned on a timestep embedding plus the
pooled text embedding, cross-attention to the text tokens) trained with the DDPM
noise-prediction loss under DDP (gloo on CPU, NCCL on GPU). Checkpoints
``<ckpt-dir>/step_<step>.pt``, every ``--ckpt-every`` steps and at the last step, hold
the model, the optimiser and the loader's position (``loader.state_dict()``, called on
every rank, saved by rank 0); ``--resume`` continues from the latest one at its step.
Rank 0 shows a progress bar and prints the throughput (samples/s) and the loader's stall
fraction at the end: the share of the training loop spent waiting for the next batch
(for the baseline that wait includes encoding it in the trainer).

The embedded Ray gets enough logical CPUs for every rank's encoder pool at full size
plus two decode tasks (``--ray-cpus`` overrides): otherwise, on a small machine, the
pools could hold every CPU while they wait for decoded input.

Randomness is a function of ``--seed`` only: augmentations come from the partition's
seeded context (sbloader) or from ``(seed, epoch, index)`` (torch), and the diffusion
noise of each step from ``(seed, rank, step)``, so a resumed run repeats an
uninterrupted one (sbloader with ``--deterministic``, the default).
"""
# The docstring above is also ``--help``'s description (sd.cli.parse_args).
#
# One module per concept; trainers/ is on sys.path (train_sd.py puts it there, and Ray
# gives its workers the driver script's folder), so they import as ``sd.<module>``:
#   sd.data         the generated Parquet, tokenizer, augmentation, ``preprocess`` (the
#                   pipeline's CPU stage), ParquetCaptionDataset and EpochSampler (torch)
#   sd.encoders     VAEEncoder, TextEncoder, SDEncoders (the encoder stage)
#   sd.denoiser     TinyUNet and the DDPM objective
#   sd.sources      BatchSource and the two loaders behind it
#   sd.checkpoints  step_<step>.pt files
#   sd.loop         train: one rank's training loop
#   sd.cli          parse_args, ray_cpus, main
# Importing ``sd`` itself imports none of them (Ray workers load only what they unpickle).
