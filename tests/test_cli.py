"""The `visbatch` command, run in-process with Typer's runner on the tiny model."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.media import write_pdf, write_video
from worker.cli.exits import EXIT_PARTIAL
from worker.cli.main import app

pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VISBATCH_MODEL", str(tiny_model_dir))
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)
    return inputs


def _run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def _job_id(result) -> str:
    return result.stdout.strip().splitlines()[-1]


def test_run_status_results(env):
    result = _run("run", str(env), "-p", "What is this?", "-p", "Any table?", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    job = _job_id(result)
    status = json.loads(_run("status", job, "--json").stdout)
    expected = {
        "id": job,
        "status": "succeeded",
        "sources_total": 2,
        "sources_failed": 0,
        "units_total": 4,
        "units_failed": 0,
        "results": 8,
        "cache_hits": 0,
        "cache_misses": 4,
        "errors": [],
    }
    assert {k: status[k] for k in expected} == expected

    lines = [json.loads(line) for line in _run("results", job).stdout.splitlines()]
    assert len(lines) == 8
    frames = [r for r in lines if r["kind"] == "video"]
    assert sorted({r["timestamp"] for r in frames}) == [0.0, 1.0]
    assert all(r["completion_tokens"] <= 4 and r["visual_tokens"] > 0 for r in lines)

    rows = list(csv.DictReader(io.StringIO(_run("results", job[:8], "--format", "csv").stdout)))
    assert len(rows) == 8 and {r["prompt_index"] for r in rows} == {"0", "1"}


def test_partial_exit_code_and_errors(env):
    (env / "notes.pdf").write_text("not a pdf at all")
    result = _run("run", str(env), "-p", "Hi", "--max-new-tokens", "2")
    assert result.exit_code == EXIT_PARTIAL
    status = json.loads(_run("status", _job_id(result), "--json").stdout)
    assert status["status"] == "partial"
    [error] = status["errors"]
    assert error["source"].endswith("notes.pdf") and "not a PDF, video or image" in error["message"]


def test_unknown_job(env):
    assert _run("db", "upgrade").exit_code == 0  # a database without that job (none: exit 4)
    result = _run("status", "0123456789abcdef")
    assert result.exit_code == 2


def test_bad_schema_is_refused(env, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "nope"}')
    result = _run("run", str(env), "-p", "x", "--schema", str(schema))
    assert result.exit_code == 2 and "schema" in result.output


def test_ingest_writes_images_and_manifest(env, tmp_path):
    out = tmp_path / "out"
    result = _run("ingest", str(env), "--out", str(out), "--longest-side", "640", "--num-frames", "3")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(records) == 2 + 3
    for record in records:
        assert (out / record["file"]).is_file()
        assert record["visual_tokens"] > 0
    pages = [r for r in records if r["kind"] == "pdf"]
    assert all(max(r["width"], r["height"]) == 640 for r in pages)
    assert "Invoice total" in pages[0]["text"]


def test_model_tiny_writes_a_loadable_model(tmp_path):
    result = _run("model", "tiny", str(tmp_path / "m"))
    assert result.exit_code == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "meaningless" in result.output


@pytest.mark.parametrize("spelling", ["qwen3-vl", "qwen3_vl", "idefics3"])
def test_model_tiny_of_another_family(tmp_path, spelling):
    from worker.models import model_type

    result = _run("model", "tiny", str(tmp_path / "m"), "--family", spelling)
    assert result.exit_code == 0, result.output
    assert model_type(str(tmp_path / "m")) == spelling.replace("-", "_")
    bad = _run("model", "tiny", str(tmp_path / "x"), "--family", "llava")
    assert bad.exit_code != 0 and "unknown family" in bad.output


def test_results_formats_and_by_document(env, tmp_path):
    import pyarrow.parquet as pq

    done = _run(
        "run", str(env / "doc.pdf"), "-p", "What is this?", "-p", "Any table?", "--max-new-tokens", "2"
    )
    assert done.exit_code == 0, done.output
    job = _job_id(done)
    rows = list(csv.DictReader(io.StringIO(_run("results", job, "--format", "csv").stdout)))
    assert [(r["page_number"], r["unit_index"], r["prompt_index"], r["prompt"]) for r in rows] == [
        ("1", "0", "0", "What is this?"),
        ("1", "0", "1", "Any table?"),
        ("2", "1", "0", "What is this?"),
        ("2", "1", "1", "Any table?"),
    ]
    refused = _run("results", job, "--format", "parquet")
    assert refused.exit_code == 2 and "add -o FILE" in refused.output
    assert _run("results", job, "--format", "xml").exit_code == 2
    written = _run("results", job, "--format", "parquet", "-o", str(tmp_path / "a.parquet"))
    assert written.exit_code == 0 and "wrote 4 answer(s)" in written.stderr
    table = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert [(r["page_number"], r["prompt"]) for r in table] == [
        (1, "What is this?"),
        (1, "Any table?"),
        (2, "What is this?"),
        (2, "Any table?"),
    ]
    by_doc = _run("results", job, "--by-document", str(tmp_path / "docs"))
    assert by_doc.exit_code == 0 and "wrote 1 Markdown file(s)" in by_doc.stderr
    [markdown] = (tmp_path / "docs").glob("doc.pdf-*.md")
    text = markdown.read_text()
    assert text.startswith("# doc.pdf\n") and text.index("## Page 1") < text.index("## Page 2")
    # The folder is the job's: written again in place, never mixed with another job's answers.
    assert _run("results", job, "--by-document", str(tmp_path / "docs")).exit_code == 0
    (env / "other.pdf").write_bytes((env / "doc.pdf").read_bytes())
    other = _job_id(_run("run", str(env / "other.pdf"), "-p", "Hi", "--max-new-tokens", "1"))
    mixed = _run("results", other, "--by-document", str(tmp_path / "docs"))
    assert mixed.exit_code == 2, mixed.output
    assert f"holds the answers of job {job}" in mixed.stderr and "another folder" in mixed.stderr
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == [".visbatch-job", markdown.name]


def test_status_errors_count_pages_from_1_and_name_the_prompt(env):
    (env / "notes.pdf").write_text("not a pdf at all")
    done = _run("run", str(env / "notes.pdf"), str(env / "doc.pdf"), "-p", "Hi", "--max-new-tokens", "2")
    assert done.exit_code == EXIT_PARTIAL
    status = json.loads(_run("status", _job_id(done), "--json").stdout)
    [error] = status["errors"]
    assert error["page_number"] is None and error["prompt_text"] is None and error["kind"] is None
    table = _run("status", _job_id(done)).stdout
    assert "notes.pdf: not a PDF, video or image" in table and "reason" not in table
