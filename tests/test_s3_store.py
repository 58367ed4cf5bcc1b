"""The object stores, against moto's real HTTP S3 API and a local folder: one contract for both."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from boto3.s3.transfer import TransferConfig

from storage.keys import UnsafeKey
from storage.object_store import (
    LocalObjectStore,
    ObjectNotFound,
    ObjectStore,
    S3ObjectStore,
    download_s3_uri,
    iter_s3_uris,
    open_object_store,
    split_s3_uri,
)

MiB = 1024 * 1024
# Low enough that a 9 MiB file goes in two parts; S3's minimum part size is 5 MiB.
REPO = Path(__file__).resolve().parents[1]
SMALL_PARTS = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


@pytest.fixture
def s3_store(s3_client: Any, s3_bucket: str) -> S3ObjectStore:
    return S3ObjectStore(s3_bucket, "fleet/store", client=s3_client, transfer_config=SMALL_PARTS)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "store")
    return request.getfixturevalue("s3_store")


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        remaining = size
        while remaining:
            chunk = os.urandom(min(remaining, MiB))
            handle.write(chunk)
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_put_get_exists_delete(store: ObjectStore) -> None:
    key = "images/ab/abcdef.png"
    assert not store.exists(key)
    store.put_bytes(key, b"pixels")
    assert store.exists(key)
    assert store.get_bytes(key) == b"pixels"
    store.delete(key)
    assert not store.exists(key)
    store.delete(key)  # idempotent


def test_missing_object_is_object_not_found(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        store.get_bytes("images/no/such.png")
    target = tmp_path / "out" / "x.bin"
    with pytest.raises(ObjectNotFound):
        store.download_file("images/no/such.png", target)
    assert not target.exists()


def test_iter_keys_by_prefix(store: ObjectStore) -> None:
    keys = ["images/aa/1.png", "images/ab/2.png", "tokens/aa/3.safetensors", "images2/x.png"]
    for key in keys:
        store.put_bytes(key, b"x")
    assert list(store.iter_keys("images/")) == ["images/aa/1.png", "images/ab/2.png"]
    assert list(store.iter_keys("images/a")) == ["images/aa/1.png", "images/ab/2.png"]
    assert list(store.iter_keys()) == sorted(keys)
    assert list(store.iter_keys("nothing/")) == []


def test_put_file_and_download_file(store: ObjectStore, tmp_path: Path) -> None:
    source = tmp_path / "in.bin"
    digest = _random_file(source, 300_000)
    store.put_file("blobs/in.bin", source)
    target = tmp_path / "deep" / "out.bin"
    store.download_file("blobs/in.bin", target)
    assert _sha256(target) == digest
    # put_file replaces what was there.
    source.write_bytes(b"new")
    store.put_file("blobs/in.bin", source)
    assert store.get_bytes("blobs/in.bin") == b"new"


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "a//b", "a\nb", "", "sp ace/x"])
def test_unsafe_keys_rejected(store: ObjectStore, key: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    for call in (
        lambda: store.put_bytes(key, b"x"),
        lambda: store.get_bytes(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
        lambda: store.put_file(key, tmp_path / "f"),
        lambda: store.download_file(key, tmp_path / "g"),
    ):
        with pytest.raises(UnsafeKey):
            call()
    with pytest.raises(UnsafeKey):
        list(store.iter_keys("../"))


def test_s3_keys_stay_under_prefix(s3_store: S3ObjectStore, s3_client: Any, s3_bucket: str) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="elsewhere/secret.txt", Body=b"no")
    s3_client.put_object(Bucket=s3_bucket, Key="fleet/store/Not A Key.txt", Body=b"foreign")
    s3_store.put_bytes("images/aa/1.png", b"x")
    listed = [item["Key"] for item in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "fleet/store/images/aa/1.png" in listed
    # Neither objects outside the prefix nor names visbatch could not address are listed.
    assert list(s3_store.iter_keys()) == ["images/aa/1.png"]


def test_multipart_upload_of_a_large_file(s3_store: S3ObjectStore, s3_client: Any, tmp_path: Path) -> None:
    source = tmp_path / "video.bin"
    digest = _random_file(source, 9 * MiB)
    s3_store.put_file("videos/big.bin", source)
    head = s3_client.head_object(Bucket=s3_store.bucket, Key="fleet/store/videos/big.bin")
    assert head["ContentLength"] == 9 * MiB
    assert head["ETag"].strip('"').endswith("-2"), "a multipart object's ETag ends in -<parts>"
    target = tmp_path / "back.bin"
    s3_store.download_file("videos/big.bin", target)
    assert _sha256(target) == digest


_DOWNLOAD_PEAK = """
import sys, tracemalloc
from pathlib import Path
from storage.object_store import S3ObjectStore, make_s3_client
endpoint, bucket, key, target = sys.argv[1:]
store = S3ObjectStore(bucket, "fleet/store", client=make_s3_client(endpoint))
tracemalloc.start()
store.download_file(key, Path(target))
print(tracemalloc.get_traced_memory()[1])
"""


def test_download_is_streamed(s3_store: S3ObjectStore, s3_server: str, tmp_path: Path) -> None:
    """Peak Python memory while downloading a 32 MiB object stays far below its size: the IO
    queue is bounded (MAX_IO_QUEUE chunks), so memory does not grow with the object.

    Measured in a child process: moto serves from this one, and its copy of the object would
    count too.
    """
    source = tmp_path / "big.bin"
    digest = _random_file(source, 32 * MiB)
    s3_store.put_file("videos/stream.bin", source)
    target = tmp_path / "stream.bin"
    args = [s3_server, s3_store.bucket, "videos/stream.bin", str(target)]
    done = subprocess.run(
        [sys.executable, "-c", _DOWNLOAD_PEAK, *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.strip().splitlines()[-1])
    assert _sha256(target) == digest
    assert peak < 12 * MiB, f"download peaked at {peak / MiB:.1f} MiB for a 32 MiB object"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("stream.bin.")], "temp file left"


def test_open_object_store_s3_url(s3_server: str, s3_bucket: str) -> None:
    store = open_object_store(f"s3://{s3_bucket}/some/prefix/", endpoint_url=s3_server)
    assert isinstance(store, S3ObjectStore)
    assert (store.bucket, store.prefix, store.url) == (
        s3_bucket,
        "some/prefix",
        f"s3://{s3_bucket}/some/prefix",
    )
    store.put_bytes("k/v.bin", b"1")
    assert store.get_bytes("k/v.bin") == b"1"
    # botocore retries transient errors (5xx, throttling, timeouts) itself, adaptively:
    # max_attempts=8 retries, so 9 attempts in all.
    retries = store.client.meta.config.retries
    assert retries == {"mode": "adaptive", "total_max_attempts": 9}


@pytest.mark.parametrize(
    "url", ["s3://Bad_Bucket/x", "s3://bucket/../up", "s3://bucket/a//b", "gs://bucket/x", "s3://b/x"]
)
def test_bad_s3_urls_rejected(url: str) -> None:
    with pytest.raises(ValueError):
        open_object_store(url, endpoint_url="http://127.0.0.1:1")


def test_user_named_objects_by_uri(s3_client: Any, s3_server: str, s3_bucket: str, tmp_path: Path) -> None:
    """Sources named by users (spaces, accents) are read by full URI, not through check_key."""
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/Rechnung März (2).pdf", Body=b"pdf bytes")
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/sub/", Body=b"")
    s3_client.put_object(Bucket=s3_bucket, Key="outside.pdf", Body=b"x")
    uris = list(iter_s3_uris(f"s3://{s3_bucket}/inbox/", client=s3_client))
    assert uris == [f"s3://{s3_bucket}/inbox/Rechnung März (2).pdf"]
    target = tmp_path / "src"
    download_s3_uri(uris[0], target, endpoint_url=s3_server)
    assert target.read_bytes() == b"pdf bytes"
    with pytest.raises(ObjectNotFound):
        download_s3_uri(f"s3://{s3_bucket}/inbox/nope.pdf", tmp_path / "n", client=s3_client)


@pytest.mark.parametrize(
    "uri", ["s3://bucket/", "s3://bucket", "s3://Bad_B/x", "s3://bucket/a\nb", "file:///x"]
)
def test_bad_object_uris_rejected(uri: str) -> None:
    with pytest.raises(ValueError):
        split_s3_uri(uri)
