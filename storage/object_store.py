"""Where page and frame images (and other blobs) are kept, by key.

The embedded shape uses a local folder; the fleet an S3 bucket (AWS or any S3-compatible store,
through ``endpoint_url``). Both are reached through ``open_object_store(url)`` so a stage never
knows which one it has. Every key goes through ``check_key``: no key can climb out of the
folder or out of the S3 prefix the store was opened on.

Credentials for S3 come from the usual AWS chain (environment, config files, instance role);
this module never reads, stores or logs them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from storage.keys import UnsafeKey, check_key

if TYPE_CHECKING:
    from visbatch.settings import Settings

log = logging.getLogger(__name__)

# Large files go up in parts of this size, several at a time (and a failed part is retried
# alone instead of the whole upload). 8 MiB is boto3's own default and S3's minimum part is 5 MiB.
MULTIPART_THRESHOLD = 8 * 1024 * 1024
MULTIPART_CHUNKSIZE = 8 * 1024 * 1024
# Downloads: network threads hand 256 KiB chunks to one disk writer through a queue. boto3's
# default queue (100 chunks) lets a download hold 25 MiB when the disk lags; 16 chunks bound it
# to ~4 MiB (+ one chunk per thread) whatever the object size, and a disk keeps up with that.
MAX_IO_QUEUE = 16

# DNS-style bucket names (what every S3-compatible store accepts).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Error codes S3 (and its imitations) use for "no such object".
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


class ObjectNotFound(KeyError):
    pass


class StoreUrlError(ValueError):
    """A URL that names no object store (a scheme other than file/s3, a bad bucket name, an unsafe
    prefix); ``setting``: the variable it came from, where the caller knows it."""

    BUCKET_RULE = "a bucket: 3-63 lowercase letters, digits, dots, hyphens"
    FORMS = f"file:///FOLDER or s3://BUCKET/PREFIX ({BUCKET_RULE})"

    def __init__(self, url: str, reason: str, setting: str | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.setting = setting


class ObjectStore(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def put_file(self, key: str, path: Path) -> None: ...

    def download_file(self, key: str, path: Path) -> None: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def iter_keys(self, prefix: str = "") -> Iterator[str]: ...


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or a key (possibly cut mid-segment) with an optional trailing '/'."""
    if prefix:
        check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class LocalObjectStore:
    """A folder; writes are atomic (temp file + rename), so a crash never leaves half an object."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_atomically(self, path: Path, fill: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                fill(handle)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if path.exists():  # content-addressed: same key, same bytes
            return
        self._write_atomically(path, lambda handle: handle.write(data))

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc

    def put_file(self, key: str, path: Path) -> None:
        """Copy a file in (overwriting), streamed, atomically."""
        target = self._path(key)
        with open(path, "rb") as source:
            self._write_atomically(target, lambda handle: shutil.copyfileobj(source, handle))

    def download_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        try:
            reader = open(source, "rb")  # noqa: SIM115 - closed below, after the atomic write
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc
        with reader:
            self._write_atomically(Path(path), lambda handle: shutil.copyfileobj(reader, handle))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix``, sorted (like an S3 listing); temp files are not keys."""
        check_prefix(prefix)
        # Walk only the deepest folder the prefix names, not the whole store.
        folder = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys = []
        for path in folder.rglob("*"):
            if path.name.startswith(".tmp-") or not path.is_file():
                continue
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                keys.append(key)
        yield from sorted(keys)


def default_transfer_config() -> Any:
    """visbatch's s3transfer settings for upload_file / download_file / copy."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(
        multipart_threshold=MULTIPART_THRESHOLD,
        multipart_chunksize=MULTIPART_CHUNKSIZE,
        max_io_queue=MAX_IO_QUEUE,
    )


def make_s3_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client with visbatch's retry and timeout policy.

    Transient failures (5xx, throttling such as SlowDown, connection errors, read timeouts)
    are retried by botocore itself: "adaptive" mode retries with exponential backoff and also
    rate-limits this client when S3 throttles, so callers never write their own retry loops.
    Only errors that survive 8 attempts reach visbatch code.
    """
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 8, "mode": "adaptive"},
        connect_timeout=10,
        read_timeout=60,
        # Path-style addressing for custom endpoints: S3-compatible stores (MinIO, Ceph, moto)
        # rarely have the wildcard DNS that virtual-hosted buckets need.
        s3={"addressing_style": "path"} if endpoint_url else {},
        max_pool_connections=32,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)


def is_not_found(exc: BaseException) -> bool:
    """True for a botocore ClientError that means "no such object"."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    return str(response.get("Error", {}).get("Code", "")) in _NOT_FOUND_CODES


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ("bucket", "some/prefix") (prefix checked, no slashes at ends)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise StoreUrlError(url, "not an s3:// URL")
    bucket = parsed.netloc
    if not _BUCKET.match(bucket):
        raise StoreUrlError(url, f"invalid S3 bucket name {bucket!r}")
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except UnsafeKey as exc:
            raise StoreUrlError(url, f"unsafe prefix: {exc}") from None
    return bucket, prefix


def _store_location(url: str) -> tuple[str, str, str]:
    """("file", folder, "") or ("s3", bucket, prefix): the URL parsed, nothing opened."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return "file", parsed.path if parsed.scheme else url, ""
    if parsed.scheme == "s3":
        return "s3", *parse_s3_url(url)
    raise StoreUrlError(url, f"unsupported scheme {parsed.scheme!r}")


def check_store_urls(settings: Settings) -> None:
    """Parse the settings' object store URLs without opening them (no I/O): a typo is the
    command's error up front, naming the variable, not a failure inside a job already started
    (or a worker's child started again and again)."""
    for setting, url in (("VISBATCH_STORE_URL", settings.object_store_url()),
                         ("VISBATCH_CACHE_COLD_URL", settings.cache_cold_url)):  # fmt: skip
        try:
            if url:
                _store_location(url)
        except StoreUrlError as exc:
            raise StoreUrlError(exc.url, exc.reason, setting) from None


class S3ObjectStore:
    """Objects under ``s3://bucket/prefix/``; the store never reads or writes outside that prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any | None = None,
        endpoint_url: str | None = None,
        transfer_config: Any | None = None,
    ) -> None:
        if not _BUCKET.match(bucket):
            raise StoreUrlError(f"s3://{bucket}", f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.client = client if client is not None else make_s3_client(endpoint_url)
        self.transfer_config = transfer_config or default_transfer_config()
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.url!r})"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_bytes(self, key: str, data: bytes) -> None:
        # No HEAD first: a PUT is atomic and replaces in one request what HEAD + PUT would do in two.
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=full)
        except Exception as exc:
            if is_not_found(exc):
                raise ObjectNotFound(key) from exc
            raise
        with response["Body"] as body:
            return body.read()

    def put_file(self, key: str, path: Path) -> None:
        """Upload a file; above the multipart threshold it goes in parallel parts (never whole in memory)."""
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=self.transfer_config)

    def download_file(self, key: str, path: Path) -> None:
        """Stream an object to ``path``. s3transfer writes a temp file beside it and renames it at the
        end, so ``path`` is never half-written."""
        full = self._key(key)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(self.bucket, full, str(path), Config=self.transfer_config)
        except Exception as exc:
            if is_not_found(exc):
                raise ObjectNotFound(key) from exc
            raise

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if is_not_found(exc):
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        # S3 answers a delete of a missing key with success too: delete is idempotent.
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys (relative to the store's prefix) starting with ``prefix``, in S3's sorted order,
        one listing page (1000 keys) at a time. Objects whose names are not valid visbatch keys
        (written by something else) are skipped: this store could not address them anyway."""
        check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
            for item in page.get("Contents", []):
                key = item["Key"][len(base) :]
                try:
                    yield check_key(key)
                except UnsafeKey:
                    log.debug("skipping object %r: not a visbatch key", item["Key"])


# -- objects named by users (sources given as s3:// URIs, drop-folder uploads) ------------------
# Their keys are whatever people upload ("Invoice March (2).pdf"), so check_key, made for
# visbatch's own content keys, would refuse them. A full s3:// URI has no store prefix to escape;
# it is only checked to be a well-formed S3 key.


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/any key`` -> (bucket, key); the key may be any S3 key without control characters."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not _BUCKET.match(parsed.netloc):
        raise ValueError(f"not an s3://bucket/key URI: {uri!r}")
    key = uri[len(f"s3://{parsed.netloc}/") :] if uri.startswith(f"s3://{parsed.netloc}/") else ""
    if not key:
        raise ValueError(f"no object key in s3://{parsed.netloc}/")
    if len(key.encode()) > 1024:
        problem = f"the key is {len(key.encode()):,} bytes, over S3's 1,024"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        problem = "the key holds control characters"
    else:
        return parsed.netloc, key
    # The name shortened and escaped: a 1 KiB key repeated in every message helps nobody.
    shown = repr(key[:60])[1:-1] + ("..." if len(key) > 60 else "")
    raise ValueError(f"not a valid S3 object key: s3://{parsed.netloc}/{shown} ({problem})")


def download_s3_uri(
    uri: str, path: Path, *, client: Any | None = None, endpoint_url: str | None = None
) -> None:
    """Stream the object at ``uri`` to ``path`` (temp file + rename); ObjectNotFound if missing."""
    bucket, key = split_s3_uri(uri)
    client = client if client is not None else make_s3_client(endpoint_url)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        client.download_file(bucket, key, str(path), Config=default_transfer_config())
    except Exception as exc:
        if is_not_found(exc):
            raise ObjectNotFound(uri) from exc
        raise


def iter_s3_uris(
    prefix_uri: str, *, client: Any | None = None, endpoint_url: str | None = None
) -> Iterator[str]:
    """Every object under ``s3://bucket/prefix`` as a full URI, sorted, folder markers left out."""
    parsed = urlparse(prefix_uri)
    if parsed.scheme != "s3" or not _BUCKET.match(parsed.netloc):
        raise ValueError(f"not an s3://bucket/prefix URI: {prefix_uri!r}")
    prefix = prefix_uri[len(f"s3://{parsed.netloc}") :].removeprefix("/")
    client = client if client is not None else make_s3_client(endpoint_url)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=parsed.netloc, Prefix=prefix):
        for item in page.get("Contents", []):
            if not item["Key"].endswith("/"):
                yield f"s3://{parsed.netloc}/{item['Key']}"


def open_object_store(url: str, *, endpoint_url: str | None = None) -> ObjectStore:
    """``file:///folder`` (or a plain path) or ``s3://bucket/prefix`` (``endpoint_url`` for non-AWS S3)."""
    kind, where, prefix = _store_location(url)
    if kind == "file":
        return LocalObjectStore(Path(where))
    return S3ObjectStore(where, prefix, endpoint_url=endpoint_url)
