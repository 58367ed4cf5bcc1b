"""Hostile and broken inputs: every file ends with results or a clear error; nothing crashes or
hangs the worker (the parsers run in a child process with a memory cap and a deadline per unit)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ingest.isolation import IsolatedSplitter, SourceInfo, StoredUnit
from ingest.limits import Limits
from ingest.spec import IngestOptions, JobSpec, Sampling
from ingest.units import SourceError, UnitFailure
from storage import repository as repo
from tests.hostile_corpus import write_corpus
from tests.media import write_pdf, write_video
from worker.drivers.embedded import run_job
from worker.runtime import Runtime


@pytest.fixture
def splitter(tmp_path):
    with IsolatedSplitter(f"file://{tmp_path / 'store'}", limits=Limits(unit_timeout_s=3)) as s:
        yield s


def test_a_hanging_source_times_out_and_the_next_one_works(splitter, tmp_path):
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)  # opening it for reading blocks forever: a stand-in for a parser loop
    started = time.monotonic()
    with pytest.raises(SourceError, match="stopped: no page or frame finished within 3 s"):
        list(splitter.split(fifo, IngestOptions()))
    assert time.monotonic() - started < 15
    items = list(splitter.split(write_pdf(tmp_path / "ok.pdf", pages=2), IngestOptions()))
    assert isinstance(items[0], SourceInfo) and len(items) == 3


def test_the_child_runs_under_the_memory_cap(tmp_path):
    """The splitting process gets an address-space limit, so a runaway allocation fails there."""
    cap = 3 << 30
    with IsolatedSplitter(f"file://{tmp_path}", limits=Limits(memory_bytes=cap)) as capped:
        assert len(list(capped.split(write_pdf(tmp_path / "ok.pdf"), IngestOptions()))) == 3
        limits = Path(f"/proc/{capped._proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
    assert line.split()[3] == str(cap)


@pytest.mark.slow
def test_corpus_through_the_pipeline(settings_factory, tmp_path):
    folder = tmp_path / "corpus"
    expected = write_corpus(folder)
    rt = Runtime(settings_factory(limit_unit_timeout_s=30))
    spec = JobSpec(prompts=["What is this?"], sampling=Sampling(max_new_tokens=2))
    job_id = run_job(rt, [folder], spec)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "partial"
    source_errors = {Path(e["source"]).name: e["message"] for e in summary["errors"] if e["unit"] is None}
    unit_errors = {Path(e["source"]).name for e in summary["errors"] if e["unit"] is not None}
    answered = {Path(r["source"]).name for r in repo.iter_results(rt.db, job_id) if r["error"] is None}
    for name, outcome in expected.items():
        if outcome == "ok":
            assert name in answered and name not in source_errors, (name, source_errors.get(name))
        elif outcome == "source":
            assert name in source_errors and source_errors[name], name
        elif outcome == "unit":
            assert name in unit_errors, name
        else:  # broken bytes: either partly readable, or a clear error; never silence
            assert name in answered or name in source_errors or name in unit_errors, name
    assert "password" in source_errors["encrypted.pdf"]
    assert "megapixels" in source_errors["bomb.png"]
    assert "no video stream" in source_errors["audio-only.mp4"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("seeds")
    return {
        "pdf": write_pdf(folder / "s.pdf", pages=1).read_bytes(),
        "mp4": write_video(folder / "s.mp4", seconds=1, size=(64, 48)).read_bytes(),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["pdf", "mp4"]),
    cut=st.floats(min_value=0.05, max_value=1.0),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 7)), max_size=20),
)
def test_fuzz_ingest_never_escapes(splitter, seeds, tmp_path, kind, cut, flips):
    """Cut and bit-flipped files: units, unit failures or a SourceError; nothing else, no hang."""
    data = bytearray(seeds[kind][: max(1, int(len(seeds[kind]) * cut))])
    for where, bit in flips:
        data[int(where * (len(data) - 1))] ^= 1 << bit
    path = tmp_path / f"fuzz.{kind}"
    path.write_bytes(bytes(data))
    try:
        for item in splitter.split(path, IngestOptions(num_frames=3)):
            assert isinstance(item, SourceInfo | StoredUnit | UnitFailure)
    except SourceError as exc:
        assert str(exc)
