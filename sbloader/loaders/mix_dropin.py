"""A mixture through the drop-in: ``sbloader.DataLoader(sbloader.mix({...torch datasets...}), ...)``.

``DataLoader(mixture, ...)`` builds a :class:`MixDataLoader` (``DataLoader.__new__`` dispatches
on the dataset). Every sample travels whole, as its dataset returned it (a :class:`Box`), through
its source's own loader (map-style: ``from_torch``, ``dataset[i]`` in remote tasks; iterable:
the drop-in with its workers); the mixture draws them in schedule order
(:class:`~sbloader.loaders.mix_loader.MixLoader`) and ``collate_fn`` makes each batch from the
drawn samples in the loop's thread, so the state is exactly what the loop took.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

from sbloader.loaders.dataloader import DataLoader

ITEM = "item"  # the column the boxed samples travel in

# What a mixture decides itself, and what to do instead.
_REFUSED = {
    "sampler": "a mixture draws each source's samples itself (without replacement, at the weights): "
               "leave sampler out; shuffle=True shuffles every map-style source",
    "batch_sampler": "a mixture cuts its batches in schedule order: leave batch_sampler out and pass batch_size",
    "generator": "a mixture's order derives from mix(..., seed=): leave generator out and set the seed there",
    "seed": "a mixture's order derives from mix(..., seed=): leave seed out and set it there",
}
# The options each kind of source's loader takes (the rest of the drop-in's sbloader options).
_COMMON = ("rank", "world_size", "job_id", "memory_budget", "allow_trainer_node", "local_start",
           "persistent_workers")
_ITERABLE_ONLY = ("num_workers", "prefetch_factor", "timeout", "worker_init_fn")


class Box:
    """One sample, as its dataset returned it, carried whole through a source's pipeline."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return Box, (self.value,)


class BoxedDataset:
    """A map-style torch dataset whose samples come as :class:`Box` es (never split into columns)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Box:
        return Box(self.dataset[i])


def box_batch(samples: list) -> dict:
    """An iterable source's collate: its samples as they are, boxed, in the column ``item``."""
    return {ITEM: [Box(s) for s in samples]}


class MixDataLoader(DataLoader):
    """A mixture (``sbloader.mix``) of torch datasets read through the drop-in ``DataLoader``'s signature.

    Batches are ``collate_fn(samples)`` of ``batch_size`` samples drawn from the sources at the
    weights (``default_collate`` by default: tensors, as torch gives them); ``collate_fn`` runs in
    the loop's process, after the mixing. ``state_dict``/``load_state_dict`` resume every source
    exactly once; ``set_weights`` reweights from the next batch. ``shuffle`` shuffles every
    map-style source (each its own epochs); ``num_workers``, ``prefetch_factor``, ``timeout`` and
    ``worker_init_fn`` go to the ``IterableDataset`` sources' loaders (a map-style source runs
    ``dataset[i]`` in Ray tasks). ``sampler``, ``batch_sampler``, ``generator`` and ``seed`` are
    refused (the mixture's seed and weights decide the order).

    Keyword-only, beyond the drop-in's: ``num_samples`` (samples per iteration; None: until the
    mixture ends, for good under ``on_exhausted="restart"``, and ``len()`` raises ``TypeError``),
    ``source_options`` (source name -> options of that source's loader only).
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Optional[Callable] = None, pin_memory: bool = False, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Optional[Callable[[int], None]] = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 num_samples: Optional[int] = None, name: Optional[str] = None,
                 source_options: Optional[Mapping[str, dict]] = None, in_order: bool = True, **options: Any) -> None:
        from torch.utils.data._utils.collate import default_collate

        given = {"sampler": sampler, "batch_sampler": batch_sampler, "generator": generator,
                 "seed": options.pop("seed", None)}
        for arg, value in given.items():
            if value is not None:
                raise ValueError(f"DataLoader({arg}=...) does not apply to a mixture: {_REFUSED[arg]}")
        if not in_order:
            raise ValueError("DataLoader(in_order=False) does not apply to a mixture: its batches are always "
                             "in schedule order (deterministic for mix(..., seed=)); leave in_order out")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"a mixture batches its samples: batch_size must be an int >= 1, found {batch_size!r}")
        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable "
                             "multiprocessing.")
        unknown = sorted(set(options) - set(_COMMON) - set(_ITERABLE_ONLY) - {"split", "snapshot_every_n_steps",
                                                                                 "pin_memory_device", "dataset_id"})
        if unknown:
            raise TypeError(f"DataLoader() of a mixture got options it does not take: {unknown}; a mixture's "
                            f"sources take {sorted(_COMMON + _ITERABLE_ONLY)} (per source: source_options=)")
        common = {k: options[k] for k in _COMMON if k in options}
        iterable = {"num_workers": num_workers, "timeout": timeout, "worker_init_fn": worker_init_fn,
                    **({"prefetch_factor": options["prefetch_factor"]} if "prefetch_factor" in options else {})}
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.sampler = self.batch_sampler = self.generator = None
        self.num_workers = num_workers
        self.collate_fn = collate_fn or default_collate
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.num_samples = num_samples
        self.persistent_workers = bool(options.get("persistent_workers", False))
        self.mixture = dataset.dropin_loader(batch_size, shuffle=self.shuffle, num_samples=num_samples,
                                             drop_last=drop_last, name=name, common=common, iterable=iterable,
                                             source_options=source_options)
        self.name = name if name is not None else getattr(self.mixture, "name", None)
        self._initialized = True

    def __del__(self) -> None:
        pass  # the sources' loaders end their own epochs

    @property
    def names(self) -> list:
        """The sources, in the order of the schedule's indices."""
        return self.mixture.names

    @property
    def weights(self) -> dict:
        """The asked weights in force now."""
        return self.mixture.weights

    def __iter__(self) -> Iterator[Any]:
        pin = False
        if self.pin_memory:
            import torch

            pin = torch.accelerator.is_available()
            if not pin:
                warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                              "then device pinned memory won't be used.", stacklevel=2)
        return self._batches(iter(self.mixture), pin)

    def _batches(self, it: Iterator[dict], pin: bool) -> Iterator[Any]:
        for b in it:
            batch = self.collate_fn([box.value for box in b[ITEM]])
            if pin:
                from torch.utils.data._utils.pin_memory import pin_memory

                batch = pin_memory(batch)
            yield batch

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("a mixture without num_samples has no len() (it runs until its sources end, or for "
                            "good under on_exhausted='restart'); pass DataLoader(mixture, num_samples=...)")
        return len(self.mixture)

    def set_epoch(self, epoch: int) -> None:
        """Accepted for trainers; a mixture goes on where it was (each source runs its own epochs)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, found {epoch}")

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """New weights from the next batch on (see :meth:`MixLoader.set_weights`)."""
        self.mixture.set_weights(weights)

    def state_dict(self) -> dict:
        """The mixture's state (``sbloader.Mix``): position, weight history, every source's cursor."""
        return self.mixture.state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True,
                        weights: Optional[Mapping[str, float]] = None) -> None:
        """Resume from :meth:`state_dict` (``weights``: new weights from there on)."""
        self.mixture.load_state_dict(state_dict, strict=strict, weights=weights)

    def stats(self) -> Any:
        """Per-source statistics (:meth:`MixLoader.stats`)."""
        return self.mixture.stats()

    def close(self) -> None:
        """Stop every source's running epoch."""
        self.mixture.close()
