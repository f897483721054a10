"""The crop workload's native peers (Ray Data, DALI CPU, SPDL, tf.data; the mixture's litdata and
torchdata), each an epoch factory over the same JPEG paths: read, random-resized-crop 224 (scale
0.08–1, ratio 3/4–4/3), random flip, uint8 CHW, batches of 64. Each peer's module is imported only
when it is built."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from benchmarks._image_workload import BATCH, SIZE, T, label_of, labels_of, load_file, process_rng


def rd_window_batch(batch: dict) -> dict:
    """Ray Data's ``map_batches`` function: the window decode (as sbloader's), crop, flip."""
    rng = process_rng()
    return {"image": np.stack([T.decode_crop_flip(b, SIZE, rng) for b in batch["bytes"]]),
            "label": labels_of(batch["path"])}


def ray_data_epochs(paths: list[str], cores: int) -> Callable[[], Iterator[Any]]:
    """``ray.data.read_binary_files(paths).map_batches(f).iter_torch_batches(64)``, a new run per epoch."""
    import logging

    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its progress lines would drown the report's log
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_binary_files(paths, include_paths=True).map_batches(rd_window_batch, batch_size=BATCH)
    return lambda: ds.iter_torch_batches(batch_size=BATCH)


def dali_epochs(paths: list[str], cores: int) -> Callable[[], Iterator[Any]]:
    """DALI's CPU pipeline (``device_id=None``), built once: ``readers.file`` +
    ``decoders.image_random_crop`` (decodes the crop window) + antialiased resize + flip."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=BATCH, num_threads=cores, device_id=None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(files=paths, labels=[label_of(p) for p in paths], random_shuffle=True)
        imgs = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0],
                                             random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        imgs = fn.resize(imgs, resize_x=SIZE, resize_y=SIZE, antialias=True)
        imgs = fn.flip(imgs, horizontal=fn.random.coin_flip())
        return fn.transpose(imgs, perm=[2, 0, 1]), labels

    p = pipe()
    p.build()
    batches = -(-len(paths) // BATCH)
    last = len(paths) - (batches - 1) * BATCH

    def epoch() -> Iterator[Any]:
        for i in range(batches):
            imgs, _ = p.run()
            a = imgs.as_array()
            yield a if i + 1 < batches else a[:last]

    return epoch


def spdl_decode(path: str) -> np.ndarray:
    """SPDL (FFmpeg): demux, decode through a crop+scale(+hflip) filter, CHW uint8."""
    import spdl.io as io

    rng = process_rng()
    packets = io.demux_image(path)
    w, h = packets.width, packets.height
    left, top, right, bottom = T.random_resized_crop_box(w, h, rng)
    flip = ",hflip" if rng.random() < 0.5 else ""
    desc = f"crop={right - left}:{bottom - top}:{left}:{top},scale={SIZE}:{SIZE}{flip},format=rgb24"
    frames = io.decode_packets(packets, filter_desc=desc)
    return np.ascontiguousarray(io.to_numpy(io.convert_frames(frames)).transpose(2, 0, 1))


def _stack(items: list) -> np.ndarray:
    return np.stack(items)


def spdl_epochs(paths: list[str], cores: int) -> Callable[[], Iterator[Any]]:
    """``spdl.pipeline``: a source of shuffled paths, the decode in ``cores`` threads, batches of 64."""
    from spdl.pipeline import PipelineBuilder

    def epoch() -> Iterator[Any]:
        order = np.random.default_rng().permutation(len(paths))
        pipe = (PipelineBuilder().add_source([paths[i] for i in order]).pipe(spdl_decode, concurrency=cores)
                .aggregate(BATCH).pipe(_stack).add_sink(3).build(num_threads=cores))
        with pipe.auto_stop():
            yield from pipe

    return epoch


def tf_data_epochs(paths: list[str], cores: int) -> Callable[[], Iterator[Any]]:
    """tf.data as its users write the Inception crop: shuffled paths, ``decode_and_crop_jpeg`` of a
    ``sample_distorted_bounding_box`` window (decodes the window only), antialiased resize, flip,
    CHW uint8, batches of 64, ``cores`` parallel calls on a private pool of ``cores`` threads."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # its start-up lines would drown the report's log
    import tensorflow as tf

    def one(path: Any, label: Any) -> tuple:
        data = tf.io.read_file(path)
        shape = tf.image.extract_jpeg_shape(data)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, tf.zeros([0, 0, 4]), area_range=(0.08, 1.0), aspect_ratio_range=(3 / 4, 4 / 3),
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
        img = tf.image.decode_and_crop_jpeg(data, window, channels=3)
        img = tf.image.resize(img, (SIZE, SIZE), antialias=True)
        img = tf.image.random_flip_left_right(tf.cast(tf.clip_by_value(img, 0, 255), tf.uint8))
        return tf.transpose(img, (2, 0, 1)), label

    options = tf.data.Options()
    options.threading.private_threadpool_size = cores
    ds = (tf.data.Dataset.from_tensor_slices((paths, [label_of(p) for p in paths])).shuffle(len(paths))
          .map(one, num_parallel_calls=cores).batch(BATCH).prefetch(tf.data.AUTOTUNE).with_options(options))
    return lambda: (img.numpy() for img, _ in ds)


# ----- the mixture's peers (scenario ``mixture``): the same sources, weights and crop ----------

def lit_item(path: str) -> dict:
    """What ``litdata.optimize`` writes per image: the JPEG's bytes and its label."""
    with open(path, "rb") as f:
        return {"image": f.read(), "label": label_of(path)}


def lit_crop(sample: dict) -> tuple:
    """litdata's ``transform``: the window decode, crop, flip (as sbloader's)."""
    return T.decode_crop_flip(sample["image"], SIZE, process_rng()), sample["label"]


def litdata_mix_epochs(parts: dict, weights: dict, cores: int, tmp: str) -> Callable[[], Iterator[Any]]:
    """Each source written once by ``litdata.optimize`` under ``tmp`` (before the timed runs) and read by
    a shuffled ``StreamingDataset`` with the crop as its ``transform``; ``CombinedStreamingDataset`` at
    the weights (which needs ``iterate_over_all=False``: its epoch ends when a worker's share of a
    source runs out); ``StreamingDataLoader`` of ``cores`` persistent workers; a run is one epoch."""
    import os

    import litdata as ld

    streams = []
    for name, paths in parts.items():
        out = os.path.join(tmp, name)
        ld.optimize(fn=lit_item, inputs=paths, output_dir=out, chunk_bytes="16MB", num_workers=1, verbose=False)
        streams.append(ld.StreamingDataset(out, shuffle=True, seed=0, transform=lit_crop))
    mixed = ld.CombinedStreamingDataset(streams, seed=0, weights=[weights[k] for k in parts], iterate_over_all=False)
    loader = ld.StreamingDataLoader(mixed, batch_size=BATCH, num_workers=cores, persistent_workers=True)
    return lambda: iter(loader)


class Shuffled:
    """A source's paths, in a new order on each pass (torchdata's ``IterableWrapper`` calls ``iter``
    on every reset)."""

    def __init__(self, paths: list, seed: int) -> None:
        self.paths, self.rng = list(paths), np.random.default_rng(seed)

    def __iter__(self) -> Iterator[str]:
        return iter([self.paths[i] for i in self.rng.permutation(len(self.paths))])


def td_crop(path: str) -> tuple:
    """torchdata's map function: read, the window decode, crop, flip (as sbloader's)."""
    return load_file(path, process_rng()), label_of(path)


def td_stack(items: list) -> tuple:
    """A batch of ``(image, label)`` pairs as two arrays."""
    return np.stack([x for x, _ in items]), np.array([y for _, y in items], dtype=np.int64)


def torchdata_mix_epochs(parts: dict, weights: dict, cores: int, method: str) -> Callable[[], Iterator[Any]]:
    """``torchdata.nodes`` as its docs compose them: a node per source over its shuffled paths,
    ``MultiNodeWeightedSampler`` at the weights (``ALL_DATASETS_EXHAUSTED``: every source's epoch once,
    as sbloader's ``on_exhausted="drop"``), the crop in a ``ParallelMapper`` of ``cores`` workers
    (``method``: threads or processes), ``Batcher``, the batch stacked, a ``Loader``; a run is one epoch."""
    import torchdata.nodes as tn

    sources = {k: tn.IterableWrapper(Shuffled(v, i)) for i, (k, v) in enumerate(parts.items())}
    node = tn.MultiNodeWeightedSampler(sources, dict(weights), stop_criteria="ALL_DATASETS_EXHAUSTED", seed=0)
    node = tn.ParallelMapper(node, td_crop, num_workers=cores, method=method)
    loader = tn.Loader(tn.Mapper(tn.Batcher(node, BATCH, drop_last=False), td_stack))
    return lambda: iter(loader)
