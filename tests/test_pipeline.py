"""The embedded pipeline end to end on the tiny model: real SQLite, real files, real transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from tests.media import write_bad_inputs, write_pdf, write_video
from worker.drivers.embedded import run_job
from worker.runtime import Runtime

pytestmark = pytest.mark.slow

SPEC = JobSpec(
    prompts=["What is on this page?", "Is there a table? Answer yes or no."],
    sampling=Sampling(max_new_tokens=6),
)


def _inputs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_pdf(folder / "invoice.pdf", pages=3)
    write_video(folder / "clip.mp4", seconds=2)
    return folder


def _result_map(rt: Runtime, job_id: str) -> dict:
    return {(r["source"], r["unit"], r["prompt_index"]): r["text"] for r in repo.iter_results(rt.db, job_id)}


def test_second_run_is_all_cache_hits(settings_factory, tmp_path):
    inputs = _inputs(tmp_path / "in")
    first = Runtime(settings_factory())
    job1 = run_job(first, [inputs], SPEC)
    s1 = repo.job_summary(first.db, job1)
    assert s1["status"] == "succeeded", s1["errors"]
    units = s1["units_total"]
    assert units == 3 + 2  # 3 pages, 2 frames at 1 fps
    assert s1["results"] == units * len(SPEC.prompts)
    assert s1["cache_misses"] == units and s1["cache_hits"] == 0
    assert first.token_store.stats.tower_calls > 0

    # A new runtime: as a second `visbatch run` would, in a new process.
    second = Runtime(settings_factory())
    job2 = run_job(second, [inputs], SPEC)
    s2 = repo.job_summary(second.db, job2)
    assert second.token_store.stats.tower_calls == 0
    assert (s2["cache_hits"], s2["cache_misses"]) == (units, 0)
    assert _result_map(second, job2) == _result_map(first, job1)
    assert all(r["cache_hit"] for r in repo.iter_results(second.db, job2))


def test_bad_sources_give_partial_with_clear_errors(settings_factory, tmp_path):
    folder = tmp_path / "mixed"
    bad = write_bad_inputs(folder)
    _inputs(folder)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "partial"
    errors = {Path(e["source"]).name: e["message"] for e in summary["errors"]}
    assert set(bad) <= set(errors), errors
    assert "password" in errors["encrypted.pdf"].lower()
    assert "no pages" in errors["zero-pages.pdf"].lower()
    assert "empty" in errors["empty.png"].lower()
    assert "no video stream" in errors["audio-only.mp4"].lower()
    results = list(repo.iter_results(rt.db, job_id))
    good = {(Path(r["source"]).name, r["unit"]) for r in results if r["error"] is None}
    assert {u for name, u in good if name == "invoice.pdf"} == {0, 1, 2}
    assert {u for name, u in good if name == "clip.mp4"} == {0, 1}


def test_json_schema_job(settings_factory, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "a.pdf", pages=2)
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["invoice", "other"]}, "has_table": {"type": "boolean"}},
        "required": ["kind", "has_table"],
        "additionalProperties": False,
    }
    spec = JobSpec(prompts=["Classify."], json_schema=schema, sampling=Sampling(max_new_tokens=40))
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [inputs], spec)
    rows = list(repo.iter_results(rt.db, job_id))
    assert len(rows) == 2
    for row in rows:
        assert row["error"] is None
        assert row["output"]["kind"] in ("invoice", "other")


def test_invalid_output_is_an_error_not_a_result(settings_factory, tmp_path):
    """Cut off before the JSON closes: recorded as an error on the request, never stored as output."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "a.pdf", pages=1)
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    spec = JobSpec(prompts=["Note."], json_schema=schema, sampling=Sampling(max_new_tokens=3))
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [inputs], spec)
    [row] = list(repo.iter_results(rt.db, job_id))
    assert row["output"] is None and "max_new_tokens" in row["error"]
    assert repo.job_summary(rt.db, job_id)["status"] == "failed"


def test_postgres_run(settings_factory, tmp_path, postgres_url):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "a.pdf", pages=2)
    rt = Runtime(settings_factory(database_url=postgres_url))
    job_id = run_job(rt, [inputs], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    rt.close()
    assert summary["status"] == "succeeded"
    assert summary["results"] == 2 * len(SPEC.prompts)
