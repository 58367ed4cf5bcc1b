"""Every page is provably its own: the long-lived splitting child never hands one source's pages
to another (issue 19: after a broker or database outage in the middle of an ingest, the next jobs
on that worker read the abandoned source's leftover replies and reported them as a success).

Real child processes, real PDFs whose pages each carry their own words, a real SQLite database;
the outage is an OperationalError raised by the unit insert (what SQLAlchemy raises when the
database goes away), the one thing injected.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy.exc
from sqlalchemy import select

from ingest.isolation import IsolatedSplitter, SourceInfo, SplitterOutOfStep, StoredUnit
from ingest.limits import Limits
from ingest.spec import IngestOptions, JobSpec, Sampling
from storage import repository as repo
from storage import units as unit_rows
from storage.errors import is_transient
from storage.models import UNITS
from tests.media import write_pdf
from worker.runtime import Runtime
from worker.stages.ingest import ingest_source

OPTIONS = IngestOptions(longest_side=200)


def _own_words(units: list[StoredUnit], word: str) -> bool:
    return all(u.text is not None and word in u.text for u in units)


@pytest.fixture
def splitter(tmp_path: Path):
    with IsolatedSplitter(f"file://{tmp_path / 'store'}", limits=Limits(unit_timeout_s=30)) as s:
        yield s


def test_a_split_dropped_mid_source_never_feeds_the_next_one(splitter, tmp_path):
    alpha = write_pdf(tmp_path / "alpha.pdf", pages=12, text="alpha words")
    beta = write_pdf(tmp_path / "beta.pdf", pages=3, text="beta words")
    abandoned = splitter.split(alpha, OPTIONS)
    assert isinstance(next(abandoned), SourceInfo)
    next(abandoned)  # one page read; the reader keeps the generator but never reads on
    items = list(splitter.split(beta, OPTIONS))
    info, units = items[0], items[1:]
    assert isinstance(info, SourceInfo) and info.units == 3
    assert [u.index for u in units] == [0, 1, 2]
    assert _own_words(units, "beta words")
    # The abandoned reader, collected late, must not kill the child of the request after it.
    abandoned.close()
    again = list(splitter.split(beta, OPTIONS))
    assert [u.index for u in again[1:]] == [0, 1, 2] and _own_words(again[1:], "beta words")


def test_a_reader_that_raises_kills_the_child(splitter, tmp_path):
    alpha = write_pdf(tmp_path / "alpha.pdf", pages=12, text="alpha words")
    items = splitter.split(alpha, OPTIONS)
    next(items)
    child = splitter._proc
    items.close()  # what `with closing(...)` does when its consumer raises
    assert child is not None and child.poll() is not None, "the child lives on with unread replies"


class _ScriptedSplitter(IsolatedSplitter):
    """A child that answers from a script: the stand-in for a child out of step (what the real one
    did after an abandoned request), since a healthy child cannot be made to misbehave."""

    def __init__(self, replies: list[dict]) -> None:
        super().__init__("file:///nonexistent")
        self.replies = replies

    def _child(self) -> subprocess.Popen:
        if self._proc is None:
            script = (
                "import json, sys\n"
                "request = json.loads(sys.stdin.readline())\n"
                f"for reply in json.loads({json.dumps(json.dumps(self.replies))}):\n"
                "    reply = {k: (request['id'] if v == 'SAME' else v) for k, v in reply.items()}\n"
                "    print(json.dumps(reply), flush=True)\n"
                "sys.stdin.read()\n"
            )
            self._proc = subprocess.Popen(
                [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
        return self._proc


SOURCE = {"source": {"kind": "pdf", "sha256": "a" * 64, "size": 10, "units": 2}}
UNIT = {"index": 0, "width": 10, "height": 10, "image_key": "images/x.png", "text": "x"}


@pytest.mark.parametrize(
    "replies",
    [
        pytest.param([{**SOURCE, "request": "an-older-request"}], id="reply-to-another-request"),
        pytest.param(
            [{**SOURCE, "request": "SAME"}, {"unit": {**UNIT, "sha256": "b" * 64}, "request": "SAME"}],
            id="unit-of-another-file",
        ),
        pytest.param([{**SOURCE, "request": "SAME"}, {**SOURCE, "request": "SAME"}], id="second-source"),
    ],
)
def test_a_reply_that_is_not_ours_is_refused_and_the_child_killed(replies, tmp_path):
    splitter = _ScriptedSplitter(replies)
    with pytest.raises(SplitterOutOfStep) as raised:
        list(splitter.split(tmp_path / "x.pdf", OPTIONS))
    assert splitter._proc is None  # killed: the next request gets a fresh child
    assert is_transient(raised.value), "an internal fault is retried, never a unit's failure"


def test_the_ingest_stage_after_an_outage_mid_source(settings_factory, tmp_path, monkeypatch):
    """The reported sequence: the database goes away while a source is split (a transient error,
    retried later), then the same worker thread splits another job's source, then the retry."""
    rt = Runtime(settings_factory())
    spec = JobSpec(prompts=["p"], sampling=Sampling(max_new_tokens=2))
    alpha = write_pdf(tmp_path / "alpha.pdf", pages=40, text="alpha words")
    beta = write_pdf(tmp_path / "beta.pdf", pages=4, text="beta words")
    job_a = repo.start_job(rt.db, spec, [(str(alpha), None)])
    job_b = repo.start_job(rt.db, spec, [(str(beta), None)])
    [(source_a, _)], [(source_b, _)] = job_a.sources, job_b.sources

    real_add_units = unit_rows.add_units
    calls = {"n": 0}

    def add_units_database_away(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise sqlalchemy.exc.OperationalError("INSERT INTO units", {}, Exception("server closed"))
        return real_add_units(*args, **kwargs)

    monkeypatch.setattr(repo, "add_units", add_units_database_away)
    monkeypatch.setattr("worker.stages.ingest.FLUSH_SECONDS", 0)  # every page its own insert
    with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
        ingest_source(rt, job_a.job_id, source_a, str(alpha), alpha, spec)
    assert is_transient(raised.value)

    step = ingest_source(rt, job_b.job_id, source_b, str(beta), beta, spec)
    assert step.units_stored == 4
    assert _texts(rt, job_b.job_id) == {i: "beta words" for i in range(4)}

    step = ingest_source(rt, job_a.job_id, source_a, str(alpha), alpha, spec)  # the retry
    assert _texts(rt, job_a.job_id) == {i: "alpha words" for i in range(40)}
    rt.close()


def _texts(rt: Runtime, job_id: str) -> dict[int, str]:
    """page index -> which document's words the stored page has."""
    stmt = select(UNITS.c.unit_index, UNITS.c.text).where(UNITS.c.job_id == job_id)
    with rt.db.session(readonly=True) as session:
        rows = session.execute(stmt.order_by(UNITS.c.unit_index)).all()
    return {index: ("alpha words" if "alpha" in text else "beta words") for index, text in rows}


def test_units_of_a_replaced_file_are_refused(db):
    job_id = repo.create_job(db, {"prompts": ["p"]})
    source_id = repo.add_source(db, job_id, "s3://bucket/report.pdf")
    row = repo.UnitRow(0, 28, 28, "images/a.png", 4)
    repo.add_units(db, job_id, source_id, [row], sha256="a" * 64)
    assert repo.add_units(db, job_id, source_id, [row], sha256="a" * 64)  # the same file: fine
    with pytest.raises(repo.SourceChanged, match="the file changed while it was being split"):
        repo.add_units(db, job_id, source_id, [repo.UnitRow(1, 28, 28, "images/b.png", 4)], sha256="b" * 64)


# Ctrl-C (issue 31) ------------------------------------------------------------------------------
# A terminal's Ctrl-C reaches its whole process group, the splitting child too: every Ctrl-C of a
# run printed the child's `KeyboardInterrupt` traceback, which looked like a crash.


def test_ctrl_c_leaves_the_child_to_its_parent(splitter, tmp_path, capfd):
    """No traceback, and no death of its own: its parent decides (a run's stop kills it, a
    worker's warm shutdown lets the source in hand finish); closing its input ends it quietly."""
    pdf = write_pdf(tmp_path / "alpha.pdf", pages=6, text="alpha words")
    items = splitter.split(pdf, OPTIONS)
    assert isinstance(next(items), SourceInfo)
    child = splitter._proc
    assert child is not None and child.stdin is not None
    child.send_signal(signal.SIGINT)
    units = list(items)  # the source goes on to its end
    assert [u.index for u in units] == [0, 1, 2, 3, 4, 5] and _own_words(units, "alpha words")
    child.stdin.close()  # its parent is done with it
    assert child.wait(timeout=30) == 0
    err = capfd.readouterr().err  # the child writes to the stderr it inherited: this one
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_child_whose_parent_left_at_once_ends_quietly(splitter, tmp_path, capfd):
    """A second Ctrl-C ends the run at once (os._exit), mid-source: the child's next reply goes
    to a closed pipe, which ends it, without a BrokenPipeError traceback after the shell's prompt."""
    pdf = write_pdf(tmp_path / "alpha.pdf", pages=40, text="alpha words")
    items = splitter.split(pdf, OPTIONS)
    assert isinstance(next(items), SourceInfo)
    child = splitter._proc
    assert child is not None and child.stdin is not None and child.stdout is not None
    child.send_signal(signal.SIGINT)
    child.stdout.close()  # what the parent's exit does to its end of the pipes
    child.stdin.close()
    assert child.wait(timeout=30) is not None
    items.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err
