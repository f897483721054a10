"""A rank's fetch of a block the coordinator owns, by its ref, with a bound.

A fetch of a borrowed ref was seen to wait in ``ray.get`` for good while its owner, the job's
coordinator, still held the block (a split rank in CI; once more for a block made again after its maker
was lost). So every fetch is bounded (:data:`FETCH_S`) and, past the bound, the block is read by the
coordinator that owns it and sent by value (:func:`read_through`): a job never hangs on one fetch.
The drop-in's ranks (``dropin_client``) and a native pipeline's (``pipeline_client``) fetch through
:func:`fetch_bounded`; :func:`get_block` is the one ``ray.get`` they make (the tests' seam).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from sbloader.core.errors import SbloaderError

logger = logging.getLogger(__name__)

FETCH_S = 60.0  # a block's fetch by its ref that lasts longer is read through the coordinator that owns it


def get_block(ref: Any, timeout_s: float) -> Any:
    """``ray.get(ref, timeout=timeout_s)``."""
    return ray.get(ref, timeout=timeout_s)


def fetch_bounded(coord: Any, ref: Any, what: str) -> Any:
    """The block of ``ref``, fetched for at most :data:`FETCH_S`, then read through ``coord``, its owner
    (``what``: the block, for the messages). Ray's errors of the fetch (the block or its maker lost, the
    owner dead) are raised for the caller.

    Raises:
        SbloaderError: the fetch did not end and the coordinator could not read the block either.
    """
    try:
        return get_block(ref, FETCH_S)
    except ray.exceptions.GetTimeoutError:
        return read_through(coord, ref, what)


def read_through(coord: Any, ref: Any, what: str) -> Any:
    """The block of ``ref`` read by the coordinator that owns it and sent by value. A coordinator that
    died raises ``RayActorError`` (the caller rebuilds).

    Raises:
        SbloaderError: the coordinator could not read it either.
    """
    logger.warning("sbloader %s did not arrive within %.0f s; reading it through the coordinator", what, FETCH_S)
    try:
        return ray.get(coord.read_block.remote([ref]))
    except ray.exceptions.RayTaskError as e:
        raise SbloaderError(f"{what} could not be fetched, and the coordinator cannot read it either. Restart "
                            "the job from the last checkpoint") from e
