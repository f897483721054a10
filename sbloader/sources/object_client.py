"""The client that reads objects in a read task: one request per object (its size comes
from the listing), or one per byte range.

Two clients, picked per URI by :func:`client_for`:

- :class:`ObstoreClient` (``obstore``, Rust's ``object_store`` under a thin binding;
  ``pip install obstore``) for ``s3://``, ``gs://`` (``gcs://``) when no ``filesystem=``
  is given: a GET per object and a ranged GET per range, many in flight without the
  GIL, about a third of pyarrow's CPU per object (``benchmarks/results/remote.md``,
  table of clients). Credentials, region and endpoint come from the same environment
  as pyarrow's (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``... ; Application Default
  Credentials for GCS, or ``STORAGE_EMULATOR_HOST`` for a GCS emulator: its address as
  the service's base URL, plain ``http`` allowed, no OAuth). Its own retries are off: :mod:`sbloader.sources.fetch`
  retries with backoff and counts every retry.
- :class:`ArrowClient` (``pyarrow.fs`` or the user's ``filesystem=``, fsspec included)
  for everything else, and when obstore is missing. pyarrow's S3 client sends a HEAD
  before each GET (it cannot take the size from the listing).

``SBLOADER_OBJECT_CLIENT=pyarrow`` (or ``obstore``) forces one (benchmarks compare them).
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Optional, Protocol
from urllib.parse import urlsplit

from sbloader.sources.filesystems import gcs_emulator, resolve, scheme_of

#: Environment variable forcing the client: ``"obstore"`` or ``"pyarrow"``.
CLIENT_ENV = "SBLOADER_OBJECT_CLIENT"

_OBSTORE_SCHEMES = frozenset({"s3", "gs", "gcs"})
_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()


class ObjectClient(Protocol):
    """Reads whole objects and byte ranges; raises ``FileNotFoundError``, ``PermissionError``
    or ``OSError`` (retryable ones: see :func:`sbloader.sources.retries.is_retryable`)."""

    name: str

    def get(self, uri: str) -> bytes:
        """The whole object."""

    def get_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""


def _obstore_error(uri: str, e: BaseException) -> BaseException:
    import obstore.exceptions as oe

    msg = f"{uri!r}: {type(e).__name__}: {e}"
    if isinstance(e, oe.NotFoundError):
        return FileNotFoundError(msg)
    if isinstance(e, (oe.PermissionDeniedError, oe.UnauthenticatedError)):
        return PermissionError(msg)
    text = str(e)
    m = re.search(r"status(?: code)?:? (\d{3})", text)
    status = int(m.group(1)) if m else None
    if status == 403 or "AccessDenied" in text:
        return PermissionError(msg)
    if status == 404:
        return FileNotFoundError(msg)
    if (status is not None and (status >= 500 or status == 429)) or "connection" in text.lower() \
            or "timed out" in text.lower() or "error sending request" in text.lower() or "IncompleteMessage" in text:
        return ConnectionError(msg)  # throttling, a server error, a dropped connection: retried
    return OSError(msg)


class ObstoreClient:
    """``obstore`` stores, one per (scheme, bucket) in this process, built from the environment."""

    name = "obstore"

    def _store(self, uri: str) -> tuple[Any, str]:
        head, _, rest = uri.partition("://")
        netloc, _, path = rest.partition("/")
        if "?" in netloc or "#" in netloc:  # (a query or a fragment in the bucket's part: parsed as a URL)
            netloc = urlsplit(uri).netloc
            path = rest[len(netloc):]
        key = (head.lower(), netloc)
        store = _STORES.get(key)  # (every GET asks: one dict's look, no URL parse, #47)
        if store is None:
            store = _make_store(scheme_of(uri), netloc)
            with _STORES_LOCK:
                store = _STORES.setdefault(key, store)
        return store, path.lstrip("/")

    def get(self, uri: str) -> bytes:
        """The whole object: one GET."""
        import obstore

        store, path = self._store(uri)
        try:
            return obstore.get(store, path).bytes().to_bytes()
        except Exception as e:
            raise _obstore_error(uri, e) from e

    def get_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: one ranged GET."""
        import obstore

        store, path = self._store(uri)
        try:
            return obstore.get_range(store, path, start=start, end=end).to_bytes()
        except Exception as e:
            raise _obstore_error(uri, e) from e


def _make_store(scheme: str, bucket: str) -> Any:
    from obstore.store import GCSStore, S3Store

    client_options: dict = {"pool_max_idle_per_host": "256"}
    retry = {"max_retries": 0}
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and endpoint.startswith("http://"):
            client_options["allow_http"] = True
        config: dict = {}
        if not (os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")):
            config["region"] = "us-east-1"
        return S3Store(bucket, config=config or None, client_options=client_options, retry_config=retry)
    emulator = gcs_emulator()
    if emulator:  # an emulator (tests): its address as the service's base URL, no OAuth
        if emulator.startswith("http://"):
            client_options["allow_http"] = True
        key = json.dumps({"gcs_base_url": emulator, "disable_oauth": True, "client_email": "", "private_key": "",
                          "private_key_id": ""})
        return GCSStore(bucket, service_account_key=key, client_options=client_options, retry_config=retry)
    return GCSStore(bucket, client_options=client_options, retry_config=retry)


class ArrowClient:
    """``pyarrow.fs`` (or the user's filesystem): HEAD and GET per object on S3."""

    name = "pyarrow"

    def __init__(self, filesystem: Any = None) -> None:
        self.filesystem = filesystem

    def get(self, uri: str) -> bytes:
        """The whole object."""
        fs, path = resolve(uri, self.filesystem)
        with fs.open_input_stream(path) as f:
            return f.read()

    def get_range(self, uri: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``."""
        fs, path = resolve(uri, self.filesystem)
        with fs.open_input_file(path) as f:
            return f.read_at(end - start, start)


def obstore_available() -> bool:
    """Whether ``obstore`` imports here."""
    try:
        import obstore.store  # noqa: F401
    except ImportError:
        return False
    return True


def client_for(uri: str, filesystem: Any = None, prefer: Optional[str] = None) -> ObjectClient:
    """The client for ``uri``: obstore for ``s3://``/``gs://`` without a ``filesystem=`` when it
    is installed, else pyarrow (see the module's docstring).

    Args:
        uri: the object's URI.
        filesystem: the user's ``filesystem=`` (then always pyarrow's interface).
        prefer: ``"obstore"`` or ``"pyarrow"``; None: ``$SBLOADER_OBJECT_CLIENT``, else the default.

    Raises:
        ValueError: ``prefer`` (or the environment variable) names no client.
    """
    want = prefer or os.environ.get(CLIENT_ENV) or ""
    if want not in ("", "obstore", "pyarrow"):
        raise ValueError(f"{CLIENT_ENV} must be 'obstore' or 'pyarrow', found {want!r}")
    if filesystem is None and want != "pyarrow" and scheme_of(uri) in _OBSTORE_SCHEMES and obstore_available():
        return _OBSTORE
    return ArrowClient(filesystem)


_OBSTORE = ObstoreClient()
