"""``from_huggingface`` over small generated ``datasets.Dataset`` s: rows equal to iterating the dataset
(in memory, memory-mapped from its cache file, through ``shuffle().select()`` indices), the
memory-mapped one shipped as its file, shuffled epochs once, resume exactly once, and a streaming
``IterableDataset`` or a ``DatasetDict`` refused with what to do."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import sbloader
from harness import check_resume_everywhere
from sbloader.sources.huggingface import StreamingDatasetError

datasets = pytest.importorskip("datasets")

N = 40


def _dataset():
    from PIL import Image

    feats = datasets.Features({"id": datasets.Value("int64"), "text": datasets.Value("string"),
                               "image": datasets.Image(), "vec": datasets.Sequence(datasets.Value("float32")),
                               "meta": {"n": datasets.Value("int32"), "tag": datasets.Value("string")}})
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "id": list(range(N)), "text": [f"caption {i}" for i in range(N)],
        "image": [Image.fromarray(rng.integers(0, 255, (6 + i % 3, 9, 3), dtype=np.uint8)) for i in range(N)],
        "vec": [rng.standard_normal(256).astype(np.float32).tolist() for _ in range(N)],
        "meta": [{"n": i, "tag": "x" * (i % 4)} for i in range(N)]}, features=feats)


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "ds")
    _dataset().save_to_disk(path)
    return datasets.load_from_disk(path)


def _assert_equal_to_iterating(ds, hf) -> None:
    ours = list(ds.iter_rows(deterministic=True))
    theirs = list(hf)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert set(a) == set(b)
        for k, v in b.items():
            if hasattr(v, "getbands"):  # an Image feature's PIL image: an HxWxC array here
                assert np.array_equal(a[k], np.asarray(v)) and a[k].dtype == np.uint8
            elif isinstance(v, list):
                assert np.allclose(np.asarray(a[k], dtype=np.float64), np.asarray(v, dtype=np.float64))
            else:
                assert a[k] == v, k


def test_rows_equal_iterating_an_in_memory_dataset(ray_session):
    hf = _dataset()
    _assert_equal_to_iterating(sbloader.from_huggingface(hf, rows_per_partition=7), hf)


def test_a_memory_mapped_dataset_travels_as_its_cache_file(ray_session, on_disk):
    assert on_disk.cache_files and on_disk.data.nbytes > 40_000
    ds = sbloader.from_huggingface(on_disk, num_partitions=4)
    assert ds.num_partitions() == 4
    # What every read task gets: the file's path, not the table.
    assert len(pickle.dumps(ds.source.shared())) < 8_000
    _assert_equal_to_iterating(ds, on_disk)


def test_selected_and_shuffled_indices_apply_as_when_iterating(ray_session, on_disk):
    hf = on_disk.shuffle(seed=3).select(range(5, 30)).filter(lambda r: r["id"] % 3 != 0)
    _assert_equal_to_iterating(sbloader.from_huggingface(hf, rows_per_partition=6), hf)


def test_a_shuffled_epoch_has_every_row_once_in_a_seeded_order(ray_session, on_disk):
    ds = sbloader.from_huggingface(on_disk.select_columns(["id", "text"]), rows_per_partition=8)
    ids = [int(i) for b in ds.iter_batches(8, shuffle=True, seed=1, deterministic=True) for i in b["id"]]
    assert sorted(ids) == list(range(N)) and ids != list(range(N))
    assert ids == [int(i) for b in ds.iter_batches(8, shuffle=True, seed=1, deterministic=True) for i in b["id"]]


def test_resumed_mid_epoch_every_row_once(ray_session, on_disk):
    hf = on_disk.select_columns(["id"]).select(range(24))

    def make(rank, world_size, name):
        return sbloader.from_huggingface(hf, rows_per_partition=5).to_dataloader(
            4, shuffle=True, seed=2, deterministic=True, rank=rank, world_size=world_size, name=name)

    check_resume_everywhere(make, list(range(24)), key="id", resume_world_sizes=(2,), same_order=True,
                            steps=[0, 3, 6], states_in_one_run=True)


def test_streaming_datasets_and_dataset_dicts_are_refused_with_what_to_do(on_disk):
    with pytest.raises(StreamingDatasetError, match="streaming=True"):
        sbloader.from_huggingface(on_disk.to_iterable_dataset())
    with pytest.raises(TypeError, match=r"from_huggingface\(ds\['train'\]\)"):
        sbloader.from_huggingface(datasets.DatasetDict({"train": on_disk, "test": on_disk}))
    with pytest.raises(TypeError, match="datasets.Dataset"):
        sbloader.from_huggingface(42)
