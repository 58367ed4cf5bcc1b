"""The S3 drop folder against moto and a real database: every object version makes exactly one job."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from ingest.drop_guard import MARKER_NAME
from ingest.dropfolder import DropFolderWatcher
from ingest.spec import JobSpec
from storage.db import Database
from storage.models import ClaimStatus, DropClaim
from storage.repository import add_source, claim_object, create_job, find_claim, job_summary, set_claim

DEFAULT = JobSpec(prompts=["What is this?"])


class Submitter:
    """Creates real jobs (like ``visbatch submit`` does) and remembers every call."""

    def __init__(self, db: Database, fail_on: Callable[[str], bool] = lambda uri: False) -> None:
        self.db = db
        self.fail_on = fail_on
        self.calls: list[tuple[str, JobSpec, str]] = []
        self._lock = threading.Lock()

    def __call__(self, uris: list[str], spec: JobSpec) -> str:
        assert len(uris) == 1
        if self.fail_on(uris[0]):
            raise RuntimeError("queue is full")
        job_id = create_job(self.db, spec)
        add_source(self.db, job_id, uris[0])
        with self._lock:
            self.calls.append((uris[0], spec, job_id))
        return job_id


def _keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """Keys under ``prefix``, without the watchers' folder markers (``ingest.drop_guard``)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = (item["Key"] for page in pages for item in page.get("Contents", []))
    return sorted(key for key in keys if not key.endswith(MARKER_NAME))


def _claims(db: Database) -> list[Any]:
    with db.session(readonly=True) as session:
        return list(session.execute(select(DropClaim.__table__).order_by(DropClaim.id)).all())


def _watcher(client: Any, db: Database, bucket: str, submit: Submitter, **kwargs: Any) -> DropFolderWatcher:
    kwargs.setdefault("default_spec", DEFAULT)
    return DropFolderWatcher(client, db, f"s3://{bucket}/inbox/", submit, **kwargs)


@pytest.fixture
def pg(postgres_db: Database) -> Database:
    return postgres_db


def test_concurrent_watchers_make_exactly_one_job_per_object(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ingest.dropfolder")
    for n in range(20):
        s3_client.put_object(Bucket=s3_bucket, Key=f"inbox/batch/doc-{n:02d}.pdf", Body=f"doc {n}".encode())
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/batch/", Body=b"")  # a console's folder marker
    submit = Submitter(pg)
    start = threading.Barrier(4)
    created: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        watcher = _watcher(s3_client, pg, s3_bucket, submit)
        try:
            start.wait()
            for _ in range(2):
                created.append(watcher.poll_once())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert not caplog.records, "a watcher hit a problem it logged and skipped"
    assert len(submit.calls) == 20
    assert sorted(job for batch in created for job in batch) == sorted(job for _, _, job in submit.calls)
    claims = _claims(pg)
    assert len(claims) == 20 and {c.status for c in claims} == {ClaimStatus.DONE}
    assert {c.job_id for c in claims} == {job for _, _, job in submit.calls}
    # Moved: the inbox holds only the folder marker; each job reads its own done/ copy.
    assert _keys(s3_client, s3_bucket, "inbox/") == ["inbox/batch/"]
    done = _keys(s3_client, s3_bucket, "done/")
    assert len(done) == 20
    for uri, _, _ in submit.calls:
        assert uri.removeprefix(f"s3://{s3_bucket}/") in done
    claim = claims[0]
    body = s3_client.get_object(Bucket=s3_bucket, Key=f"done/{claim.id}/{claim.key.removeprefix('inbox/')}")
    assert body["Body"].read().startswith(b"doc ")


def test_redrop_same_content_no_new_job_new_content_new_job(
    s3_client: Any, s3_bucket: str, pg: Database
) -> None:
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit)
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"version 1")
    assert len(watcher.poll_once()) == 1

    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"version 1")  # same bytes again
    assert watcher.poll_once() == []
    assert len(submit.calls) == 1
    assert _keys(s3_client, s3_bucket, "inbox/") == []  # the duplicate is moved on all the same

    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"version 2")  # new content
    second = watcher.poll_once()
    assert len(second) == 1 and len(submit.calls) == 2
    first_uri, second_uri = submit.calls[0][0], submit.calls[1][0]
    assert first_uri != second_uri, "a new upload must not overwrite what the first job reads"
    for uri, body in ((first_uri, b"version 1"), (second_uri, b"version 2")):
        key = uri.removeprefix(f"s3://{s3_bucket}/")
        assert s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == body


def test_spec_files(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    put = lambda key, body: s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)  # noqa: E731
    put("inbox/invoices/_spec.json", json.dumps({"prompts": ["Total?"], "json_schema": {"type": "object"}}))
    put("inbox/invoices/march.pdf", b"m")
    put("inbox/invoices/2026/april.pdf", b"a")  # nearest _spec.json above it
    put("inbox/invoices/special.pdf.spec.json", json.dumps({"prompts": ["Vendor?"]}))
    put("inbox/invoices/special.pdf", b"s")
    put("inbox/loose.pdf", b"l")  # no spec file: the default
    submit = Submitter(pg)
    _watcher(s3_client, pg, s3_bucket, submit).poll_once()

    by_name = {uri.rsplit("/", 1)[-1]: spec for uri, spec, _ in submit.calls}
    assert set(by_name) == {"march.pdf", "april.pdf", "special.pdf", "loose.pdf"}  # specs are not jobs
    assert by_name["march.pdf"].prompts == ["Total?"] and by_name["march.pdf"].json_schema == {
        "type": "object"
    }
    assert by_name["april.pdf"].prompts == ["Total?"]
    assert by_name["special.pdf"].prompts == ["Vendor?"]
    assert by_name["loose.pdf"] == DEFAULT
    # The job row carries the spec it was made with.
    job_id = next(job for uri, _, job in submit.calls if uri.endswith("march.pdf"))
    assert job_summary(pg, job_id)["spec"]["prompts"] == ["Total?"]
    # Spec files stay: they configure their folder for later drops.
    assert _keys(s3_client, s3_bucket, "inbox/") == [
        "inbox/invoices/_spec.json",
        "inbox/invoices/special.pdf.spec.json",
    ]


def test_objects_wait_for_a_usable_spec(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit, default_spec=None)
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/x/a.pdf", Body=b"a")
    assert watcher.poll_once() == []  # no spec and no default: not claimed, left in place
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/x/_spec.json", Body=b'{"prompts": []}')
    assert watcher.poll_once() == []  # invalid spec (no prompt): still waiting
    assert _claims(pg) == []
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/x/_spec.json", Body=b'{"prompts": ["Q?"]}')
    assert len(watcher.poll_once()) == 1
    assert submit.calls[0][1].prompts == ["Q?"]


def test_failed_submit_moves_to_failed(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    submit = Submitter(pg, fail_on=lambda uri: uri.endswith("bad.pdf"))
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/bad.pdf", Body=b"b")
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/good.pdf", Body=b"g")
    watcher = _watcher(s3_client, pg, s3_bucket, submit)
    assert len(watcher.poll_once()) == 1

    claim = next(c for c in _claims(pg) if c.key == "inbox/bad.pdf")
    assert claim.status == ClaimStatus.FAILED and claim.job_id is None
    assert claim.error is not None and "queue is full" in claim.error
    assert _keys(s3_client, s3_bucket, "inbox/") == []
    # The reason is written beside the moved object, where the user looks for it.
    note_key = f"failed/{claim.id}/bad.pdf.error.json"
    assert _keys(s3_client, s3_bucket, "failed/") == [f"failed/{claim.id}/bad.pdf", note_key]
    note = json.loads(s3_client.get_object(Bucket=s3_bucket, Key=note_key)["Body"].read())
    assert note["subject"] == "inbox/bad.pdf" and note["claim"] == claim.id
    assert "queue is full" in note["error"] and "another name" in note["what_to_do"]
    assert [k for k in _keys(s3_client, s3_bucket, "done/") if k.endswith("bad.pdf")] == []
    # Dropping the same bytes again is not a retry: it goes straight to failed/ again.
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/bad.pdf", Body=b"b")
    assert watcher.poll_once() == []
    assert _keys(s3_client, s3_bucket, "inbox/") == []


def test_without_moves_objects_stay_and_make_one_job(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit, done_prefix=None, failed_prefix=None)
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/keep.pdf", Body=b"k")
    assert len(watcher.poll_once()) == 1
    assert watcher.poll_once() == []
    assert submit.calls[0][0] == f"s3://{s3_bucket}/inbox/keep.pdf"
    assert _keys(s3_client, s3_bucket) == ["inbox/keep.pdf"]
    assert [c.status for c in _claims(pg)] == [ClaimStatus.DONE]


def test_run_loop_stops(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit, poll_seconds=0.05)
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/loop.pdf", Body=b"l")
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(stop,))
    thread.start()
    for _ in range(200):
        if submit.calls:
            break
        stop.wait(0.05)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert len(submit.calls) == 1


def test_claims_are_exclusive(db: Database) -> None:
    """The claim primitive on both backends: one winner per (bucket, key, etag)."""
    first = claim_object(db, "bucket", "inbox/a.pdf", "etag-1")
    assert first is not None
    assert claim_object(db, "bucket", "inbox/a.pdf", "etag-1") is None
    assert claim_object(db, "bucket", "inbox/a.pdf", "etag-2") not in (None, first)
    job_id = create_job(db, DEFAULT)
    set_claim(db, first, status=ClaimStatus.SUBMITTED, job_id=job_id)
    set_claim(db, first, status=ClaimStatus.DONE)
    claim = find_claim(db, "bucket", "inbox/a.pdf", "etag-1")
    assert claim is not None and (claim.status, claim.job_id, claim.error) == ("done", job_id, None)
    with pytest.raises(ValueError):
        set_claim(db, first, status="nonsense")


def test_inbox_inside_done_prefix_is_refused(s3_client: Any, sqlite_db: Database) -> None:
    with pytest.raises(ValueError):
        DropFolderWatcher(s3_client, sqlite_db, "s3://bucket/done/inbox/", Submitter(sqlite_db), DEFAULT)
