"""Fixtures for the fleet's services: a real Redis, and S3 through moto's ThreadedMotoServer.

Redis comes from ``VISBATCH_TEST_REDIS_URL`` (default: the local server, db 0). Like PostgreSQL
(tests/conftest.py), an unreachable Redis skips its tests, except under ``CI=true`` where it
fails them. Tests share the server, so each gets its own key prefix and only keys under that
prefix are deleted afterwards (never FLUSHDB: other tests, or a developer's data, may live there).

S3 is moto's real HTTP S3 API on 127.0.0.1 (no MinIO binary is installable here), one server
per session on a free port, with fake credentials in the environment; each test gets its own
bucket, emptied and deleted afterwards.

Fixtures:
  ``redis_url``           base URL of the test Redis (skip/fail when unreachable)
  ``redis_prefix``        a fresh key prefix for this test; its keys are deleted afterwards
  ``closed_port``         a local TCP port where nothing listens (a Redis that is down)
  ``s3_server``           (session) endpoint URL of the moto server
  ``s3_client``           (session) a boto3 S3 client on it, with visbatch's retry policy
  ``s3_bucket``           a fresh bucket name for this test
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

from tests.faults import free_port

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_base_url() -> str:
    return os.environ.get("VISBATCH_TEST_REDIS_URL", DEFAULT_REDIS_URL)


def _skip_or_fail(reason: str, hint: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: service tests must run, not skip)", pytrace=False)
    pytest.skip(f"{reason}; {hint}")


@cache
def _redis_unreachable_reason() -> str | None:
    import redis

    url = _redis_base_url()
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except Exception as exc:  # any error means "not available here"
        host = url.rsplit("@", 1)[-1]  # never print a password
        return f"Redis at {host} is not reachable: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        client.close()
    return None


@pytest.fixture
def redis_url() -> str:
    reason = _redis_unreachable_reason()
    if reason is not None:
        _skip_or_fail(reason, "set VISBATCH_TEST_REDIS_URL to run the Redis tests")
    return _redis_base_url()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    import redis

    prefix = f"visbatch-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on (bound and released: connection refused, immediately)."""
    return free_port()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    patch = pytest.MonkeyPatch()
    # Fake credentials, so the AWS chain never finds (or sends) real ones to the test server.
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        patch.delenv(name, raising=False)
    patch.setenv("AWS_ACCESS_KEY_ID", "testing")
    patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        patch.undo()


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Any:
    # One client for the session: boto3 clients are thread-safe, and building one costs ~0.3 s.
    from storage.object_store import make_s3_client

    return make_s3_client(s3_server)


@pytest.fixture
def s3_bucket(s3_client: Any) -> Iterator[str]:
    bucket = f"vb-test-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=bucket)
    yield bucket
    # Free moto's memory (multi-MiB test objects) and leave nothing behind.
    for upload in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        s3_client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3_client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    s3_client.delete_bucket(Bucket=bucket)


DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@cache
def _rabbitmq_unreachable_reason() -> str | None:
    from kombu import Connection

    url = os.environ.get("VISBATCH_TEST_RABBITMQ_URL", DEFAULT_RABBITMQ_URL)
    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.connect()
    except Exception as exc:  # any error means "not available here"
        host = url.rsplit("@", 1)[-1]  # never print a password
        return f"RabbitMQ at {host} is not reachable: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


@pytest.fixture
def rabbitmq_url() -> str:
    """A real RabbitMQ broker (skip outside CI when unreachable, fail under CI=true)."""
    reason = _rabbitmq_unreachable_reason()
    if reason is not None:
        _skip_or_fail(reason, "set VISBATCH_TEST_RABBITMQ_URL to run the RabbitMQ tests")
    return os.environ.get("VISBATCH_TEST_RABBITMQ_URL", DEFAULT_RABBITMQ_URL)
