"""A native pipeline as a ``torch.utils.data.IterableDataset`` (``ds.to_torch_dataset()``)."""
from __future__ import annotations

from typing import Any, Iterator


def _torch_iterable_base() -> type:
    from torch.utils.data import IterableDataset

    return IterableDataset


class TorchIterableDataset(_torch_iterable_base()):  # type: ignore[misc]
    """A ``torch.utils.data.IterableDataset`` of ready batches from a pipeline.

    Use it with ``torch.utils.data.DataLoader(it, batch_size=None)``: batching and
    preprocessing already happen on the cluster. With torch workers > 1 every
    worker would run the whole pipeline, so that raises an error.
    """

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                f"to_torch_dataset() is already parallel on the cluster; torch's DataLoader has "
                f"num_workers={info.num_workers}, which would load every batch {info.num_workers} times. "
                "Use num_workers=0 and batch_size=None."
            )
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration."""
        self._loader.set_epoch(epoch)
