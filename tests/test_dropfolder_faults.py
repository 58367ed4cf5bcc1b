"""The drop folder under faults and as an operator runs it.

* S3 (moto's real HTTP API) behind a TCP proxy that the tests cut: an outage in the middle of a
  move never turns an object into a failure or a second job, and what cannot be moved is said with
  a shortened name. The watcher's client there retries nothing (botocore's own retries would only
  make the outage longer to wait out; the watcher's behaviour after them is what is tested).
* A real ``visbatch watch`` process (the whole path: ``worker.drivers.fleet.submit.submit_job``
  creating jobs in PostgreSQL and queueing their ingest tasks on Redis), whose log is read.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from sqlalchemy import select

from ingest.spec import JobSpec
from storage.db import Database
from storage.models import DROP_CLAIMS, JOBS, ClaimStatus
from tests.faults import TCPProxy
from tests.test_dropfolder import Submitter
from worker.drivers.dropfolder.guard import MARKER_NAME
from worker.drivers.dropfolder.watcher import DropFolderWatcher

# Budget: S3 outages waited out and a real `watch` process; to be tightened (issue 20).
pytestmark = [pytest.mark.faults, pytest.mark.budget(150, reason="S3 outages waited out, a watch process")]

DEFAULT = JobSpec(prompts=["What is this?"])
ROOT = Path(__file__).resolve().parents[1]
VISBATCH = str(Path(sys.executable).with_name("visbatch"))


def _keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = (item["Key"] for page in pages for item in page.get("Contents", []))
    return sorted(key for key in keys if not key.endswith(MARKER_NAME))


def _claims(db: Database) -> list[Any]:
    with db.session(readonly=True) as session:
        return list(session.execute(select(DROP_CLAIMS).order_by(DROP_CLAIMS.c.id)).all())


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith(("ingest", "worker.drivers"))
    ]  # not moto's request log


@pytest.fixture
def pg(postgres_db: Database) -> Database:
    return postgres_db


@pytest.fixture
def proxy(s3_server: str) -> Iterator[TCPProxy]:
    proxy = TCPProxy(int(urlparse(s3_server).port or 0))
    yield proxy
    proxy.close()


def _client_via(proxy: TCPProxy) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 1, "mode": "standard"},  # one attempt: no retry hides the cut
        connect_timeout=2,
        read_timeout=10,
        s3={"addressing_style": "path"},
    )
    return boto3.session.Session().client("s3", endpoint_url=f"http://127.0.0.1:{proxy.port}", config=config)


class CutOn:
    """A boto3 client whose ``method`` first cuts the proxy (once): the fault lands exactly there.
    Every other call goes straight to the real client."""

    def __init__(
        self, client: Any, proxy: TCPProxy, method: str, when: Callable[..., bool] = lambda *args, **kw: True
    ):
        self._client, self._proxy, self._method, self._when = client, proxy, method, when
        self.cuts = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if name != self._method:
            return attribute

        def cut_then_call(*args: Any, **kwargs: Any) -> Any:
            if self.cuts == 0 and self._when(*args, **kwargs):
                self.cuts += 1
                self._proxy.cut()
            return attribute(*args, **kwargs)

        return cut_then_call


def test_s3_cut_during_the_copy_gives_the_claim_back(
    s3_client: Any, s3_bucket: str, pg: Database, proxy: TCPProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the claim was marked failed ("could not copy"), and once S3 was back the object went
    to failed/ with no job: a 1-second outage lost the document."""
    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"a")
    submit = Submitter(pg)
    client = CutOn(_client_via(proxy), proxy, "copy")
    watcher = DropFolderWatcher(client, pg, f"s3://{s3_bucket}/inbox/", submit, DEFAULT)

    assert watcher.poll_once() == []
    assert client.cuts == 1 and submit.calls == []
    assert _claims(pg) == []  # given back, not failed
    assert _keys(s3_client, s3_bucket, "inbox/") == ["inbox/a.pdf"]
    assert _keys(s3_client, s3_bucket, "failed/") == []
    assert any("not moved now" in r.getMessage() and r.levelno == logging.WARNING for r in _ours(caplog))

    proxy.restore()
    assert len(watcher.poll_once()) == 1
    [claim] = _claims(pg)
    assert claim.status == ClaimStatus.DONE and claim.job_id == submit.calls[0][2]
    assert _keys(s3_client, s3_bucket, "inbox/") == []
    assert _keys(s3_client, s3_bucket, "done/") == [f"done/{claim.id}/a.pdf"]


def test_an_outage_while_watching_loses_nothing_and_doubles_nothing(
    s3_client: Any, s3_bucket: str, pg: Database, proxy: TCPProxy
) -> None:
    """S3 goes away for 1.5 s in the middle of a batch (right after a job is made, before its
    object leaves the inbox), while the watcher's loop keeps polling."""
    names = [f"inbox/batch/doc-{n:02d}.pdf" for n in range(24)]
    for name in names:
        s3_client.put_object(Bucket=s3_bucket, Key=name, Body=name.encode())

    class CuttingSubmitter(Submitter):
        def __call__(self, uris: list[str], spec: JobSpec) -> str:
            job_id = super().__call__(uris, spec)
            if len(self.calls) == 5:
                proxy.cut()
                threading.Timer(1.5, proxy.restore).start()
            return job_id

    submit = CuttingSubmitter(pg)
    watcher = DropFolderWatcher(
        _client_via(proxy), pg, f"s3://{s3_bucket}/inbox/", submit, DEFAULT, poll_seconds=0.05
    )
    stop = threading.Event()
    loop = threading.Thread(target=watcher.run, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            claims = _claims(pg)
            if len(claims) == len(names) and all(c.status == ClaimStatus.DONE for c in claims):
                break
            time.sleep(0.2)
    finally:
        stop.set()
        loop.join(30)
    claims = _claims(pg)
    assert sorted(c.key for c in claims) == names  # one claim per object...
    assert {c.status for c in claims} == {ClaimStatus.DONE}
    assert len(submit.calls) == len(names)  # ... and one job each
    assert sorted(c.job_id for c in claims) == sorted(job for _, _, job in submit.calls)
    assert _keys(s3_client, s3_bucket, "inbox/") == []
    assert _keys(s3_client, s3_bucket, "failed/") == []
    for uri, _, _ in submit.calls:  # every job's copy is there, with its own bytes
        key = uri.removeprefix(f"s3://{s3_bucket}/")
        body = s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert key.endswith(body.decode().removeprefix("inbox/"))


def test_an_object_that_cannot_be_moved_is_reported_with_a_short_name(
    s3_client: Any, s3_bucket: str, pg: Database, proxy: TCPProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Submit fails for good and S3 goes away at that moment, so the object cannot be moved to
    failed/. Before: the log repeated the whole 1 KiB key, on every poll."""
    caplog.set_level(logging.INFO, logger="worker.drivers.dropfolder.watcher")
    long_key = "inbox/" + "q" * 1000 + ".pdf"
    s3_client.put_object(Bucket=s3_bucket, Key=long_key, Body=b"q")

    def refuse_and_cut(uris: list[str], spec: JobSpec) -> str:
        proxy.cut()
        raise RuntimeError("the job was refused")

    watcher = DropFolderWatcher(_client_via(proxy), pg, f"s3://{s3_bucket}/inbox/", refuse_and_cut, DEFAULT)
    assert watcher.poll_once() == []
    [claim] = _claims(pg)
    assert claim.status == ClaimStatus.FAILED and "the job was refused" in claim.error
    assert _keys(s3_client, s3_bucket, "inbox/") == [long_key]  # not moved: it stays
    stuck = [r.getMessage() for r in _ours(caplog) if "could not be moved to failed/" in r.getMessage()]
    assert len(stuck) == 1 and "qqq...qqq" in stuck[0] and "(1,010 bytes)" in stuck[0]
    assert "tried again" in stuck[0]

    proxy.restore()
    assert watcher.poll_once() == []
    failed = _keys(s3_client, s3_bucket, "failed/")
    assert len(failed) == 2 and all(len(k.encode()) <= 1024 for k in failed)
    assert _keys(s3_client, s3_bucket, "inbox/") == []
    note = json.loads(
        s3_client.get_object(Bucket=s3_bucket, Key=next(k for k in failed if k.endswith(".error.json")))[
            "Body"
        ].read()
    )
    assert note["subject"] == long_key and "the job was refused" in note["error"]
    messages = [r.getMessage() for r in _ours(caplog)] + [claim.error]
    assert not [m for m in messages if "q" * 200 in m], "a message repeats the whole key"
    assert not [m for m in messages if "\n" in m], "a message spans lines"


def test_s3_cut_while_reading_a_spec_is_not_a_spec_error(
    s3_client: Any, s3_bucket: str, pg: Database, proxy: TCPProxy
) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/_spec.json", Body=json.dumps({"prompts": ["Spec?"]}))
    s3_client.put_object(Bucket=s3_bucket, Key="inbox/a.pdf", Body=b"a")
    client = CutOn(_client_via(proxy), proxy, "get_object", lambda **kw: kw["Key"].endswith("_spec.json"))
    submit = Submitter(pg)
    watcher = DropFolderWatcher(client, pg, f"s3://{s3_bucket}/inbox/", submit, DEFAULT)
    assert watcher.poll_once() == []  # the spec could not be read: its objects wait
    assert client.cuts == 1 and submit.calls == [] and _claims(pg) == []
    proxy.restore()
    assert len(watcher.poll_once()) == 1
    assert submit.calls[0][1].prompts == ["Spec?"]  # waited for its spec, never took the default
    assert _keys(s3_client, s3_bucket, "inbox/") == ["inbox/_spec.json"]  # and no error note


# -- a real `visbatch watch` process ---------------------------------------------------------------


@pytest.fixture
def watch_env(
    tmp_path: Path, postgres_url: str, pg: Database, s3_server: str, redis_url: str, redis_prefix: str
) -> dict[str, str]:
    """The environment of a `visbatch watch` of this tree: this test's PostgreSQL schema, the moto
    S3 API, its own broker key prefix on the test Redis (deleted afterwards)."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VISBATCH_HOME": str(tmp_path / "home"),
        "VISBATCH_DATABASE_URL": postgres_url,
        "VISBATCH_S3_ENDPOINT_URL": s3_server,
        "VISBATCH_BROKER_URL": redis_url,
        "VISBATCH_BROKER_PREFIX": redis_prefix,
    }


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            pytest.fail(f"visbatch watch exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"timed out; visbatch watch log:\n{log.read_text()[-3000:]}")


def test_watch_refuses_a_prefix_holding_the_store(
    watch_env: dict[str, str], s3_client: Any, s3_bucket: str, pg: Database
) -> None:
    """Before: `watch s3://bucket/` with the store at s3://bucket/store moved the store's objects to
    done/ and made a job of each; now it exits 2 at start with one line saying why."""
    s3_client.put_object(Bucket=s3_bucket, Key="store/images/ab/cd.png", Body=b"png")
    env = {**watch_env, "VISBATCH_STORE_URL": f"s3://{s3_bucket}/store"}
    try:
        done = subprocess.run(
            [VISBATCH, "watch", f"s3://{s3_bucket}/", "-p", "What is this?", "--poll-seconds", "0.2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,  # generous: a shared CI box can be slow to start Python
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("visbatch watch did not refuse the prefix: it kept running")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: refusing to watch"), done.stderr
    assert "object store (VISBATCH_STORE_URL)" in lines[0] and "Traceback" not in done.stderr
    assert _keys(s3_client, s3_bucket) == ["store/images/ab/cd.png"] and _claims(pg) == []


def test_watch_refuses_a_mistyped_prefix_before_it_makes_a_database(tmp_path: Path) -> None:
    """Before: `watch bucket/inbox` (no s3://) created the current folder's database, then refused
    with no fix. The folders are checked first: nothing is made, and the fix says the form."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")}
    env |= {"PYTHONPATH": str(ROOT), "VISBATCH_HOME": str(tmp_path / "home")}
    for prefix, why in (("bucket/inbox", "not an s3:// URL"), ("s3://Bad_Bucket/in", "invalid S3 bucket")):
        done = subprocess.run(
            [VISBATCH, "watch", prefix], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        error, fix = done.stderr.splitlines()
        assert done.returncode == 2 and error.startswith(f"error: PREFIX {prefix}: {why}"), done.stderr
        assert fix.startswith("fix: give the inbox as s3://BUCKET/PREFIX/ (a bucket: 3-63 lowercase"), fix
    assert list(tmp_path.iterdir()) == [], "a refused watch made files"


def test_watch_of_a_missing_bucket_exits_at_its_first_poll(watch_env: dict[str, str], pg: Database) -> None:
    """Before: a watch whose first listing can never work (no such bucket, no credentials) logged
    a traceback every poll and made no job, for as long as it ran. Now it exits 4 at once, naming
    the inbox and the cause; a listing that may work later (S3 away) is still waited out."""
    done = subprocess.run(
        [VISBATCH, "watch", "s3://no-such-bucket-here/inbox/", "-p", "hi", "--poll-seconds", "0.2"],
        env=watch_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 4, done.stderr
    assert "error: cannot watch s3://no-such-bucket-here/inbox/: NoSuchBucket:" in done.stderr
    assert "Traceback" not in done.stderr
    assert "fix: check the inbox's bucket, VISBATCH_S3_ENDPOINT_URL and the AWS credentials" in done.stderr
    assert _claims(pg) == []


def test_watch_process_says_what_it_does_in_its_log(
    watch_env: dict[str, str], tmp_path: Path, s3_client: Any, s3_bucket: str, pg: Database
) -> None:
    """At its default log level, a `visbatch watch` says: each job it made, each unusable spec
    file and why (with the note beside it), and each re-drop that made no job and why."""
    put = lambda key, body: s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)  # noqa: E731
    put("inbox/bad/_spec.json", json.dumps({"prompts": ["Q?"], "json_schema": {"type": "nonsense"}}))
    put("inbox/bad/a.pdf", b"a")
    put("inbox/good/_spec.json", json.dumps({"prompts": ["First?"]}))
    put("inbox/good/b.pdf", b"b bytes")
    log = tmp_path / "watch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [VISBATCH, "watch", f"s3://{s3_bucket}/inbox/", "--poll-seconds", "0.2"],
            env=watch_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        bad_note = "inbox/bad/_spec.json.error.json"
        _wait_for(
            lambda: (
                "inbox/good/b.pdf" not in _keys(s3_client, s3_bucket, "inbox/")
                and bad_note in _keys(s3_client, s3_bucket, "inbox/")
            ),
            proc,
            log,
        )
        [claim] = _claims(pg)
        assert claim.status == ClaimStatus.DONE and claim.key == "inbox/good/b.pdf"
        put("inbox/good/_spec.json", json.dumps({"prompts": ["Second?"]}))
        put("inbox/good/b.pdf", b"b bytes")  # the same bytes again, under a changed spec
        _wait_for(lambda: "inbox/good/b.pdf" not in _keys(s3_client, s3_bucket, "inbox/"), proc, log)
        _wait_for(lambda: "same content" in log.read_text(), proc, log, timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    with pg.session(readonly=True) as session:
        jobs = list(session.execute(select(JOBS.c.id, JOBS.c.spec)).all())
    assert [spec["prompts"] for _, spec in jobs] == [["First?"]]  # one job, with the first spec
    lines = text.splitlines()
    [made] = [line for line in lines if "inbox/good/b.pdf -> job" in line]
    assert made.startswith("INFO ") and jobs[0][0] in made
    [bad] = [line for line in lines if "inbox/bad/_spec.json" in line and "unusable" in line]
    assert bad.startswith("WARNING ") and "invalid JSON schema" in bad
    [redrop] = [line for line in lines if "same content" in line]
    assert redrop.startswith("INFO ") and "no new job" in redrop and jobs[0][0] in redrop
    note = json.loads(s3_client.get_object(Bucket=s3_bucket, Key=bad_note)["Body"].read())
    assert note["error"].startswith("invalid job spec: json_schema: invalid JSON schema:")
    assert "inbox/bad/a.pdf" in _keys(s3_client, s3_bucket, "inbox/")  # waits for a usable spec
