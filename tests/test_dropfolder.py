"""The S3 drop folder against moto and a real database: every object version makes exactly one job."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from ingest.spec import JobSpec
from storage.db import Database
from storage.models import DROP_CLAIMS, ClaimStatus
from storage.repository import add_source, claim_object, create_job, find_claim, job_summary, set_claim
from worker.drivers.dropfolder.guard import MARKER_NAME
from worker.drivers.dropfolder.watcher import DropFolderWatcher

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
    """Keys under ``prefix``, without the watchers' folder markers (``worker.drivers.dropfolder.guard``)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = (item["Key"] for page in pages for item in page.get("Contents", []))
    return sorted(key for key in keys if not key.endswith(MARKER_NAME))


def _claims(db: Database) -> list[Any]:
    with db.session(readonly=True) as session:
        return list(session.execute(select(DROP_CLAIMS).order_by(DROP_CLAIMS.c.id)).all())


def _watcher(client: Any, db: Database, bucket: str, submit: Submitter, **kwargs: Any) -> DropFolderWatcher:
    kwargs.setdefault("default_spec", DEFAULT)
    return DropFolderWatcher(client, db, f"s3://{bucket}/inbox/", submit, **kwargs)


@pytest.fixture
def pg(postgres_db: Database) -> Database:
    return postgres_db


def test_concurrent_watchers_make_exactly_one_job_per_object(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="worker.drivers.dropfolder.watcher")
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


# -- spec files are checked like every other door (issue 15, items 3 and 5) ---------------------


def _note(client: Any, bucket: str, key: str) -> dict[str, Any]:
    return json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


BAD_SPECS = {
    "invalid schema": {"prompts": ["Q?"], "json_schema": {"type": "nonsense", "properties": 5}},
    "schema too deep": {"prompts": ["Q?"], "json_schema": _deep_schema(40)},
    "schema too big": {
        "prompts": ["Q?"],
        "json_schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}},
    },
    "unknown field": {"prompts": ["Q?"], "prompt_typo": "x"},
    "no prompt": {"prompts": []},
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_unusable_spec_says_why_beside_it_and_its_objects_wait(
    case: str, s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the watcher made a job with an invalid schema (that then failed every answer), or
    logged "unusable spec file (1 validation error for JobSpec)" and nothing else."""
    from ingest.spec import SpecError, spec_from_fields

    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    fields = BAD_SPECS[case]
    with pytest.raises(SpecError) as expected:  # the Python door, for the message to compare
        spec_from_fields(fields)
    put = lambda key, body: s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)  # noqa: E731
    put("inbox/x/_spec.json", json.dumps(fields))
    put("inbox/x/a.pdf", b"a")
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit)

    assert watcher.poll_once() == [] and watcher.poll_once() == []
    assert submit.calls == [] and _claims(pg) == []  # no job, nothing claimed: the object waits
    assert _keys(s3_client, s3_bucket, "inbox/") == [
        "inbox/x/_spec.json",
        "inbox/x/_spec.json.error.json",
        "inbox/x/a.pdf",
    ]
    note = _note(s3_client, s3_bucket, "inbox/x/_spec.json.error.json")
    assert note["subject"] == "inbox/x/_spec.json"
    assert note["error"] == str(expected.value)  # the same words as every other door
    assert "wait" in note["what_to_do"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per spec version, not once per poll
    assert str(expected.value) in warnings[0] and "inbox/x/_spec.json" in warnings[0]

    # Fixed: the object goes through with the new spec and the note goes away.
    put("inbox/x/_spec.json", json.dumps({"prompts": ["Fixed?"], "json_schema": {"type": "object"}}))
    assert len(watcher.poll_once()) == 1
    assert submit.calls[0][1].prompts == ["Fixed?"]
    assert _keys(s3_client, s3_bucket, "inbox/") == ["inbox/x/_spec.json"]


def test_spec_errors_read_the_same_at_every_door(
    s3_client: Any, s3_bucket: str, pg: Database, tmp_path: Any
) -> None:
    """CLI --schema, a drop folder's _spec.json and JobSpec(...) in Python: one check, one message."""
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from ingest.spec import JobSpec, describe_spec_error
    from worker.cli.main import app

    schema = {"type": "nonsense", "properties": 5}
    with pytest.raises(ValidationError) as api:
        JobSpec(prompts=["Q?"], json_schema=schema)
    message = f"invalid job spec: {describe_spec_error(api.value)}"
    assert message == "invalid job spec: json_schema: invalid JSON schema: 5 is not of type 'object'"

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = CliRunner().invoke(app, ["submit", "s3://b/k.pdf", "-p", "Q?", "--schema", str(path)])
    assert result.exit_code == 2 and message in " ".join(result.output.split())

    s3_client.put_object(
        Bucket=s3_bucket, Key="inbox/_spec.json", Body=json.dumps({"prompts": ["Q?"], "json_schema": schema})
    )
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"a")
    _watcher(s3_client, pg, s3_bucket, Submitter(pg)).poll_once()
    assert _note(s3_client, s3_bucket, "inbox/_spec.json.error.json")["error"] == message


def test_a_5000_deep_spec_file_is_a_spec_error(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    depth = 5000
    body = '{"prompts": ["Q?"], "json_schema": ' + '{"type": "object", "properties": {"x": ' * depth
    body += "{}" + "}}" * depth + "}"
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/_spec.json", Body=body.encode())
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"a")
    submit = Submitter(pg)
    assert _watcher(s3_client, pg, s3_bucket, submit).poll_once() == []
    note = _note(s3_client, s3_bucket, "inbox/_spec.json.error.json")
    assert note["error"] == "invalid job spec: nested deeper than 32 levels (the limit of a JSON schema)"
    assert submit.calls == []


# -- re-drops say why they make no job (item 8) ----------------------------------------------------


def test_redrop_after_a_spec_change_says_why_no_job(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the re-dropped object was deleted with nothing said at the default level (the
    `watch` command's level is tested with a real process in test_dropfolder_faults.py)."""
    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    put = lambda key, body: s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)  # noqa: E731
    put("inbox/_spec.json", json.dumps({"prompts": ["First?"]}))
    put("inbox/a.pdf", b"same bytes")
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit)
    [job_id] = watcher.poll_once()
    caplog.clear()

    put("inbox/_spec.json", json.dumps({"prompts": ["Second?"]}))
    put("inbox/a.pdf", b"same bytes")
    assert watcher.poll_once() == []
    assert len(submit.calls) == 1 and _keys(s3_client, s3_bucket, "inbox/") == ["inbox/_spec.json"]
    [line] = [r.getMessage() for r in caplog.records if "same content" in r.getMessage()]
    claim = _claims(pg)[0]
    assert f"claim {claim.id}" in line and job_id in line and "no new job" in line
    assert "spec changed" in line and "another name" in line
    assert next(r for r in caplog.records if "same content" in r.getMessage()).levelno == logging.INFO


# -- keys near S3's 1,024-byte limit (item 6) ------------------------------------------------------


def test_long_key_moves_to_a_key_that_fits_and_its_job_can_read_it(
    s3_client: Any, s3_bucket: str, pg: Database, s3_server: str, tmp_path: Any
) -> None:
    """Before: done/<n>/ + a 1,020-byte name was over the limit, and the job's source failed with
    "not a valid S3 object key in 's3://...'" repeating the whole key."""
    from storage.object_store import download_s3_uri, split_s3_uri

    long_key = "inbox/" + "Rechnung März " * 60 + "x" * (1024 - 6 - len(("Rechnung März " * 60).encode()) - 4)
    long_key += ".pdf"
    assert len(long_key.encode()) == 1024
    s3_client.put_object(Bucket=s3_bucket, Key=long_key, Body=b"%PDF long")
    submit = Submitter(pg)
    assert len(_watcher(s3_client, pg, s3_bucket, submit).poll_once()) == 1

    [(uri, _, _)] = submit.calls
    bucket, key = split_s3_uri(uri)  # what the ingest stage does first: accepted
    assert bucket == s3_bucket and len(key.encode()) <= 1024
    claim = _claims(pg)[0]
    assert key.startswith(f"done/{claim.id}/Rechnung März ") and key.endswith(".pdf")
    assert claim.key == long_key  # the claim keeps the original name
    download_s3_uri(uri, tmp_path / "src", client=s3_client)  # ... and reads it, as ingest does
    assert (tmp_path / "src").read_bytes() == b"%PDF long"
    assert _keys(s3_client, s3_bucket, "inbox/") == []


def test_long_key_failure_is_reported_with_a_shortened_name(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    long_key = "inbox/deep/" + "n" * 1000 + ".pdf"
    s3_client.put_object(Bucket=s3_bucket, Key=long_key, Body=b"b")
    submit = Submitter(pg, fail_on=lambda uri: True)
    assert _watcher(s3_client, pg, s3_bucket, submit).poll_once() == []

    claim = _claims(pg)[0]
    assert claim.status == ClaimStatus.FAILED and "queue is full" in claim.error
    failed = _keys(s3_client, s3_bucket, "failed/")
    assert len(failed) == 2 and all(len(k.encode()) <= 1024 for k in failed)
    note = _note(s3_client, s3_bucket, next(k for k in failed if k.endswith(".error.json")))
    assert note["subject"] == long_key  # the full name as data, once
    ours = [
        r.getMessage() for r in caplog.records if r.name.startswith(("ingest", "worker.drivers"))
    ]  # not moto's
    messages = [*ours, claim.error, note["error"]]
    assert any("nnn...nnn" in m and "bytes)" in m for m in messages)
    assert not [m for m in messages if "n" * 200 in m], "a message repeats the whole key"


def test_control_characters_in_a_name_never_reach_a_job_or_a_log(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    from storage.object_store import split_s3_uri

    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    key = "inbox/scan\rINFO forged log line\x07.pdf"  # moto refuses a newline; S3 takes both
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"c")
    submit = Submitter(pg)
    assert len(_watcher(s3_client, pg, s3_bucket, submit).poll_once()) == 1
    split_s3_uri(submit.calls[0][0])  # a key the ingest stage accepts
    ours = [r.getMessage() for r in caplog.records if r.name.startswith(("ingest", "worker.drivers"))]
    assert all("\r" not in m and "\x07" not in m for m in ours)
    assert any("scan\\x0dINFO forged log line\\x07.pdf" in m for m in ours)


# -- prefixes a watcher must not take (item 4) -----------------------------------------------------


def test_refuses_an_inbox_holding_the_store_or_the_cache(
    s3_client: Any, s3_bucket: str, pg: Database
) -> None:
    """Before: `watch s3://bucket/` with the store at s3://bucket/store moved the store's images and
    cached tokens to done/ and made a job of each."""
    from visbatch.settings import Settings
    from worker.drivers.dropfolder.guard import WatcherRefused

    s3_client.put_object(Bucket=s3_bucket, Key="store/images/ab/cd.png", Body=b"png")
    s3_client.put_object(Bucket=s3_bucket, Key="cache/tokens/ab.safetensors", Body=b"t")
    settings = Settings(store_url=f"s3://{s3_bucket}/store", cache_cold_url=f"s3://{s3_bucket}/cache")
    submit = Submitter(pg)
    for inbox, done, what in (
        (f"s3://{s3_bucket}/", "done/", "object store"),
        (f"s3://{s3_bucket}/store/inbox/", "done/", "object store"),  # inside the store
        (f"s3://{s3_bucket}/inbox/", "cache/done/", "cold token cache"),  # moves into the cache
    ):
        with pytest.raises(WatcherRefused, match=what) as refused:
            DropFolderWatcher.from_settings(settings, inbox, pg, submit, done_prefix=done)
        assert "\n" not in str(refused.value)
    # A store in another bucket, or a local one, is no obstacle.
    other = Settings(store_url="s3://another-bucket/store", cache_cold_url=None)
    DropFolderWatcher.from_settings(other, f"s3://{s3_bucket}/", pg, submit)
    assert submit.calls == [] and _claims(pg) == []
    assert _keys(s3_client, s3_bucket) == ["cache/tokens/ab.safetensors", "store/images/ab/cd.png"]


def test_refuses_an_inbox_holding_another_watchers_folders(
    s3_client: Any, s3_bucket: str, pg: Database
) -> None:
    from worker.drivers.dropfolder.guard import WatcherRefused

    put = lambda key, body: s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)  # noqa: E731
    first = DropFolderWatcher(
        s3_client, pg, f"s3://{s3_bucket}/in-a/", Submitter(pg), DEFAULT, done_prefix="archive/done/"
    )
    put("in-a/a.pdf", b"a")
    assert len(first.poll_once()) == 1  # its done copy now lives under archive/done/
    before = _keys(s3_client, s3_bucket)

    # A second watcher on a prefix that contains the first one's done folder.
    second = DropFolderWatcher(s3_client, pg, f"s3://{s3_bucket}/archive/", Submitter(pg), DEFAULT)
    with pytest.raises(WatcherRefused, match="done folder of the watcher of"):
        second.poll_once()
    # A third whose own done folder lies inside the first one's inbox.
    third = DropFolderWatcher(
        s3_client, pg, f"s3://{s3_bucket}/in-c/", Submitter(pg), DEFAULT, done_prefix="in-a/done/"
    )
    with pytest.raises(WatcherRefused, match="lies inside the inbox of another watcher"):
        third.poll_once()
    assert _keys(s3_client, s3_bucket) == before  # nothing moved, nothing claimed
    assert len(_claims(pg)) == 1


def test_refuses_a_moved_folder_without_markers(s3_client: Any, s3_bucket: str, pg: Database) -> None:
    """Done folders from watchers older than the markers are recognised by their claim rows."""
    from worker.drivers.dropfolder.guard import MARKER_NAME, WatcherRefused

    old = DropFolderWatcher(s3_client, pg, f"s3://{s3_bucket}/inbox/", Submitter(pg), DEFAULT)
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"a")
    assert len(old.poll_once()) == 1
    for folder in ("inbox/", "done/", "failed/"):  # as an old version left them: no markers
        s3_client.delete_object(Bucket=s3_bucket, Key=folder + MARKER_NAME)
    with pytest.raises(WatcherRefused, match="objects a drop-folder watcher moved there"):
        DropFolderWatcher(
            s3_client, pg, f"s3://{s3_bucket}/", Submitter(pg), DEFAULT, done_prefix="processed/"
        ).poll_once()


def test_a_folder_marked_after_start_is_left_alone(
    s3_client: Any, s3_bucket: str, pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    from worker.drivers.dropfolder.guard import MARKER_NAME

    caplog.set_level(logging.WARNING, logger="worker.drivers.dropfolder.watcher")
    submit = Submitter(pg)
    watcher = _watcher(s3_client, pg, s3_bucket, submit)
    assert watcher.poll_once() == []
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/theirs/" + MARKER_NAME, Body=b"{}")
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/theirs/7/x.pdf", Body=b"x")
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/mine.pdf", Body=b"m")
    assert len(watcher.poll_once()) == 1
    assert [uri.rsplit("/", 1)[-1] for uri, _, _ in submit.calls] == ["mine.pdf"]
    assert "inbox/theirs/7/x.pdf" in _keys(s3_client, s3_bucket, "inbox/")
    assert any("belongs to another drop-folder watcher" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "relative",
    [
        "a.pdf",
        "x" * 1018 + ".pdf",
        "dir/" * 200 + "é" * 100 + ".mp4",  # multi-byte characters at the cut
        "名" * 340,  # 1,020 bytes, no extension
        "weird.\x01" + "e" * 40,  # a control character, an over-long "extension"
    ],
)
def test_moved_and_note_keys_always_fit(relative: str) -> None:
    from worker.drivers.dropfolder.guard import MAX_FOLDER_BYTES
    from worker.drivers.dropfolder.keys import MAX_KEY_BYTES, display_key, error_key, fits, moved_key

    prefix = "d" * (MAX_FOLDER_BYTES - 1) + "/"  # the longest done prefix a watcher accepts
    for folder in ("done/", prefix):
        key = moved_key(folder, 2**63 - 1, relative)
        assert fits(key) and key.startswith(f"{folder}{2**63 - 1}/")
        if fits(f"{folder}{2**63 - 1}/{relative}"):
            assert key.endswith(relative)  # untouched when it fits
        assert fits(error_key(key, folder)) and error_key(key, folder).endswith(".error.json")
    assert len(display_key("inbox/" + relative)) <= 96 + len(" (1,024 bytes)")
    assert error_key("inbox/" + relative, "inbox/").startswith("inbox/")
    assert len(error_key("inbox/" + relative, "inbox/").encode()) <= MAX_KEY_BYTES


def test_claims_given_back_and_looked_up(db: Database) -> None:
    """The queries beyond claim/set/find, on both backends: only a claim still ``claimed`` can be
    given back (no job exists for it yet); any other stays, so exactly once holds."""
    from storage.claims import claim_keys, release_claim

    first = claim_object(db, "bucket", "inbox/a.pdf", "etag-1")
    second = claim_object(db, "bucket", "inbox/b.pdf", "etag-1")
    assert first is not None and second is not None
    set_claim(db, second, status=ClaimStatus.FAILED, error="no")
    assert claim_keys(db, [first, second, 999_999]) == {
        first: ("bucket", "inbox/a.pdf"),
        second: ("bucket", "inbox/b.pdf"),
    }
    assert release_claim(db, second) is False  # failed: kept
    assert release_claim(db, first) is True
    assert find_claim(db, "bucket", "inbox/a.pdf", "etag-1") is None
    again = claim_object(db, "bucket", "inbox/a.pdf", "etag-1")  # claimable again, exactly once
    assert again is not None and claim_object(db, "bucket", "inbox/a.pdf", "etag-1") is None
