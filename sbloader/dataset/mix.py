"""``sbloader.mix``: several native datasets read as one, at set weights.

Each source keeps its own pipeline (its own stages, shuffle window and loader); the
mixture happens after them, in :class:`~sbloader.loaders.mix_loader.MixLoader`.
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional

from sbloader.core import mix_plan
from sbloader.dataset.read import from_torch
from sbloader.loaders import pipeline_state
from sbloader.loaders.mix_loader import MixLoader

_MIX_COUNTER = itertools.count()


class MixedDataset:
    """Several datasets mixed at set weights (build one with :func:`mix`).

    Attributes:
        datasets: name -> the source :class:`~sbloader.dataset.dataset.Dataset`.
        weights: name -> the weight asked at the start.
        seed: the mixture's seed.
        on_exhausted: ``"restart"``, ``"stop"`` or ``"drop"`` (see :func:`mix`).
    """

    def __init__(self, datasets: Mapping[str, Any], weights: Mapping[str, float], seed: int,
                 on_exhausted: str) -> None:
        if not isinstance(datasets, Mapping) or not datasets:
            raise ValueError(f"mix() takes a non-empty dict of name -> Dataset, found {datasets!r}")
        self.given = dict(datasets)  # as given: the drop-in form boxes the torch datasets' samples
        datasets = {name: _as_dataset(name, ds) for name, ds in datasets.items()}
        if on_exhausted not in mix_plan.ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {mix_plan.ON_EXHAUSTED}, found {on_exhausted!r}")
        if not isinstance(seed, int):
            raise ValueError(f"mix() needs an int seed (the schedule derives from it), found {seed!r}")
        self.datasets = dict(datasets)
        self.weights = dict(weights)
        mix_plan.check_weights(self.weights, list(self.datasets))
        self.seed = seed
        self.on_exhausted = on_exhausted

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: {ds!r} @ {self.weights[n]}" for n, ds in self.datasets.items())
        return f"MixedDataset({inner})"

    def to_dataloader(self, batch_size: int = 256, *, shuffle: bool = False, num_samples: Optional[int] = None,
                      drop_last: bool = False, source_key: Optional[str] = None, name: Optional[str] = None,
                      source_options: Optional[Mapping[str, dict]] = None, **kwargs: Any) -> MixLoader:
        """A loader yielding dicts of torch tensors drawn from the sources at the weights.

        Args:
            batch_size: rows per batch of the mixture (each source's loader reads batches of
                this size too).
            shuffle: shuffle every source (each its own epochs, reshuffled per source epoch).
            num_samples: samples per iteration of the loader (None: until the mixture ends;
                for good under ``on_exhausted="restart"``).
            drop_last: drop a final short batch.
            source_key: add a column of that name holding each row's source (its index in
                ``loader.names``), for per-source losses.
            name: the loader's name in the job (its sources' loaders are named ``name.source``).
            source_options: source name -> options of that source's loader only (over ``kwargs``),
                e.g. ``{"web": {"shuffle_window": "2 GiB"}, "stream": {"num_workers": 4}}``.
            **kwargs: every source loader's options (:class:`~sbloader.loaders.pipeline_loader.PipelineLoader`:
                memory_budget, prefetch_blocks, shuffle_window, rank, world_size...); the sources
                always run ``deterministic=True`` under a seed drawn from the mixture's.
        """
        for key in ("seed", "deterministic", "generator", "collate_fn"):
            if key in kwargs or any(key in o for o in (source_options or {}).values()):
                raise ValueError(f"mix().to_dataloader() sets {key!r} for its sources itself (the mixture's seed "
                                 "fixes every source's, delivered in a fixed order); leave it out")
        base = name if name is not None else f"mix{next(_MIX_COUNTER)}"

        options = dict(source_options or {})
        unknown = sorted(set(options) - set(self.datasets))
        if unknown:
            raise ValueError(f"source_options names sources {unknown} that the mixture does not have; its sources: "
                             f"{list(self.datasets)}")

        def make(source: str, seed: int) -> Any:
            return self.datasets[source].to_dataloader(batch_size, shuffle=shuffle, seed=seed, deterministic=True,
                                                       name=f"{base}.{source}",
                                                       **{**kwargs, **options.get(source, {})})

        prints = {n: ds.fingerprint(batch_size) if isinstance(ds, TorchIterableSource)
                  else pipeline_state.fingerprint(ds, batch_size, shuffle) for n, ds in self.datasets.items()}
        loader = MixLoader(list(self.datasets), make, self.weights, seed=self.seed, batch_size=batch_size,
                           on_exhausted=self.on_exhausted, num_samples=num_samples, drop_last=drop_last,
                           source_key=source_key, fingerprints=prints)
        loader.name = base
        return loader

    @staticmethod
    def dropin_loader_class() -> type:
        """The class ``sbloader.DataLoader(mixture, ...)`` builds (``DataLoader.__new__`` asks)."""
        from sbloader.loaders.mix_dropin import MixDataLoader

        return MixDataLoader

    def dropin_loader(self, batch_size: int, *, shuffle: bool, num_samples: Optional[int], drop_last: bool,
                      name: Optional[str], common: dict, iterable: dict,
                      source_options: Optional[Mapping[str, dict]]) -> MixLoader:
        """The loader behind ``sbloader.DataLoader(mixture, ...)``: batches ``{"item": [Box(sample)...]}``
        (:mod:`~sbloader.loaders.mix_dropin`), every torch dataset's samples as it returns them.

        ``common`` goes to every source's loader, ``iterable`` to the ``IterableDataset`` sources' only.
        """
        from sbloader.loaders import mix_dropin

        boxed, options = {}, {}
        for n, ds in self.given.items():
            if _is_torch_iterable(ds):
                boxed[n], options[n] = TorchIterableSource(ds, collate_fn=mix_dropin.box_batch), dict(iterable)
            elif not hasattr(ds, "to_dataloader") and hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
                boxed[n], options[n] = from_torch(mix_dropin.BoxedDataset(ds), columns="item"), {}
            else:
                raise TypeError(f"sbloader.DataLoader(mixture) reads torch datasets; source {n!r} is a "
                                f"{type(ds).__name__}: iterate a mixture of sbloader Datasets with "
                                "mix(...).to_dataloader(batch_size) instead")
        for n, extra in (source_options or {}).items():
            options.setdefault(n, {}).update(extra)
        inner = MixedDataset(boxed, self.weights, self.seed, self.on_exhausted)
        return inner.to_dataloader(batch_size, shuffle=shuffle, num_samples=num_samples, drop_last=drop_last,
                                   name=name, source_options=options, **common)


def _as_dataset(name: Any, ds: Any) -> Any:
    """A source as a native Dataset: as given, or a map-style torch dataset through ``from_torch``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"mix() source names must be non-empty strings, found {name!r}")
    if hasattr(ds, "to_dataloader"):
        return ds
    if _is_torch_iterable(ds):
        return TorchIterableSource(ds)
    if hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        return from_torch(ds)
    raise TypeError(f"mix() source {name!r} is a {type(ds).__name__}; give sbloader Datasets, map-style torch "
                    "datasets or torch IterableDatasets")


def _is_torch_iterable(ds: Any) -> bool:
    import torch.utils.data

    return isinstance(ds, torch.utils.data.IterableDataset)


class TorchIterableSource:
    """A torch ``IterableDataset`` as a mixture's source: read by sbloader's drop-in
    :class:`~sbloader.loaders.dataloader.DataLoader` (its workers, its per-worker shard state),
    in order, under the seed the mixture gives it.

    Attributes:
        dataset: the ``IterableDataset`` (yielding dicts: the mixture's columns).
    """

    _DROPIN_OPTIONS = ("rank", "world_size", "job_id", "memory_budget", "allow_trainer_node", "local_start",
                       "prefetch_factor", "num_workers", "persistent_workers", "worker_num_cpus", "timeout",
                       "worker_init_fn", "pin_memory", "device")

    def __init__(self, dataset: Any, collate_fn: Any = None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __repr__(self) -> str:
        return f"TorchIterableSource({type(self.dataset).__name__})"

    def fingerprint(self, batch_size: int) -> dict:
        """What a state must match: the dataset's type and the batching."""
        return {"iterable": type(self.dataset).__qualname__, "batch_size": batch_size}

    def to_dataloader(self, batch_size: int, *, shuffle: bool = False, seed: Optional[int] = None,
                      deterministic: bool = True, name: Optional[str] = None, **kwargs: Any) -> Any:
        """The drop-in loader over the dataset (``shuffle`` does not apply to an iterable; options
        the drop-in does not take are left out)."""
        from sbloader.loaders.dataloader import DataLoader

        options = {k: v for k, v in kwargs.items() if k in self._DROPIN_OPTIONS}
        return DataLoader(self.dataset, batch_size=batch_size, seed=seed, in_order=deterministic, name=name,
                          collate_fn=self.collate_fn, **options)


def mix(datasets: Mapping[str, Any], weights: Mapping[str, float], *, seed: int = 0,
        on_exhausted: str = "restart") -> MixedDataset:
    """Read several datasets as one, drawing each sample from a source at the given weights.

    Each source keeps its own pipeline (its stages, its shuffle window); the mixture is
    made after them. Which source the ``i``-th sample comes from is a pure function of
    ``seed``, ``i`` and the weights in force (never of workers or timing); within a source
    sampling is without replacement: its samples are all seen once before any repeats.

    Args:
        datasets: name -> :class:`~sbloader.dataset.dataset.Dataset`, a map-style torch
            dataset (read through :func:`~sbloader.dataset.read.from_torch`) or a torch
            ``IterableDataset`` (read by the drop-in ``DataLoader``, resumed through its own
            per-worker state); map every source to the same columns.
        weights: name -> weight (>= 0; normalised; 0 leaves a source out until
            ``loader.set_weights`` brings it in).
        seed: the mixture's seed (the schedule and every source's shuffle derive from it).
        on_exhausted: what a source that runs out of its epoch does: ``"restart"`` (default:
            it starts its next epoch), ``"stop"`` (the loader's iteration ends) or ``"drop"``
            (it is left out and its weight shared among the rest until every source ran out).

    Returns:
        A :class:`MixedDataset`; iterate ``.to_dataloader(batch_size, ...)``, whose
        ``set_weights``, ``state_dict``/``load_state_dict`` and ``stats`` work mid-run.

    Example:
        >>> mixed = sbloader.mix({"web": web, "curated": curated}, weights={"web": 0.7, "curated": 0.3})
        >>> loader = mixed.to_dataloader(batch_size=256, shuffle=True, num_samples=1_000_000)
    """
    return MixedDataset(datasets, weights, seed, on_exhausted)
