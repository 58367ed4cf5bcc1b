"""The Python API (`import visbatch`): the same options, stage code and records as the CLI.

Runs on the tiny model in this process (the embedded shape, SQLite, a folder); `submit` against
the real Redis broker in a subprocess (the Celery app reads its broker from the environment
once per process), with no worker: the job is queued, its ingest task is on the broker, and
`cancel` stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import visbatch
from tests.media import write_pdf, write_video
from worker.results_export import EXPORT_FIELDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def folder(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VISBATCH_MODEL", str(tiny_model_dir))
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "doc.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)
    (inputs / "notes.txt").write_text("not a document")
    return inputs


def test_importing_visbatch_imports_no_torch():
    code = "import sys, visbatch, worker.cli.main; assert 'torch' not in sys.modules, 'torch'; print('ok')"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_options_are_checked_like_the_cli(folder):
    with pytest.raises(visbatch.Error) as bad:
        visbatch.run([folder], prompts=["Hi"], detail="ultra")
    assert str(bad.value) == "detail='ultra': input should be 'low', 'medium', 'high' or 'auto'"
    with pytest.raises(TypeError, match="unknown option.*longest_sid"):
        visbatch.run([folder], prompts=["Hi"], longest_sid=100)
    with pytest.raises(visbatch.Error, match="no prompt"):
        visbatch.run([folder], prompts=[])
    with pytest.raises(visbatch.Error, match=r"no such file or folder: .*nope\.pdf") as missing:
        visbatch.run([folder / "nope.pdf"], prompts=["Hi"])  # issue 31: was a bare FileNotFoundError
    assert missing.value.fix == "check the path (folders are walked)"


@pytest.mark.slow
def test_run_results_pandas_files_and_reopen(folder, tmp_path):
    job = visbatch.run([folder], prompts=["What is this?", "Any table?"], max_new_tokens=3, longest_side=448)
    assert job.status == "succeeded" and job.errors == []
    records = list(job.results())
    assert len(records) == (2 + 2) * 2  # notes.txt was skipped (not a document)
    pages = [(r["page_number"], r["unit_index"], r["prompt"]) for r in records if r["kind"] == "pdf"]
    assert pages == [
        (1, 0, "What is this?"),
        (1, 0, "Any table?"),
        (2, 1, "What is this?"),
        (2, 1, "Any table?"),
    ]
    frames = [r for r in records if r["kind"] == "video"]
    assert {r["timestamp"] for r in frames} == {0.0, 1.0} and all(r["page_number"] is None for r in frames)

    frame = job.to_pandas()
    assert frame.shape == (8, len(EXPORT_FIELDS)) and list(frame["prompt"].unique()) == [
        "What is this?",
        "Any table?",
    ]

    import pyarrow.parquet as pq

    table = pq.read_table(job.write(tmp_path / "a.parquet"))
    assert table.num_rows == 8 and table.schema.field("page_number").type == "int32"
    assert [json.loads(line)["prompt"] for line in job.write(tmp_path / "a.jsonl").read_text().splitlines()][
        :2
    ] == [
        "What is this?",
        "Any table?",
    ]
    files = job.by_document(tmp_path / "docs")
    doc = next(f for f in files if f.name.startswith("doc.pdf-")).read_text()
    assert doc.index("## Page 1") < doc.index("## Page 2") and doc.count("**Any table?**") == 2

    again = visbatch.job(job.id[:8])
    assert again.id == job.id and list(again.results()) == records
    assert visbatch.jobs()[0]["id"] == job.id


@pytest.mark.slow
def test_a_schema_job_gives_json_answers_and_json_documents(folder, tmp_path):
    schema = json.loads((ROOT / "examples" / "invoice.schema.json").read_text())
    job = visbatch.run([folder / "doc.pdf"], prompts=["Extract the fields."], schema=schema, pages="1")
    [record] = list(job.results())
    assert record["error"] is None and set(record["output"]) == {"vendor", "total", "has_table"}
    [path] = job.by_document(tmp_path / "docs")
    document = json.loads(path.read_text())
    assert (
        document["pages"][0]["page_number"] == 1
        and document["pages"][0]["answers"][0]["output"] == record["output"]
    )


@pytest.mark.postgres
def test_submit_queues_the_job_on_the_broker_and_cancel_stops_it(
    tmp_path, redis_url, redis_prefix, postgres_url
):
    pdf = write_pdf(tmp_path / "doc.pdf", pages=1)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")},
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "VISBATCH_HOME": str(tmp_path / "home"),
        "VISBATCH_DATABASE_URL": postgres_url,
        "VISBATCH_BROKER_URL": redis_url,
        "VISBATCH_BROKER_PREFIX": redis_prefix,
        "VISBATCH_MODEL": "Qwen/Qwen2-VL-2B-Instruct",  # recorded, never loaded: no worker here
    }
    code = (
        "import sys, visbatch\n"
        f"job = visbatch.submit([{str(pdf)!r}], prompts=['Hi'], max_new_tokens=4)\n"
        "print(job.id, job.status)\n"
        "print(job.cancel().status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    (job_id, status), (cancelled,) = (line.split() for line in done.stdout.splitlines())
    assert status == "running" and cancelled == "cancelled"
    client = redis.Redis.from_url(redis_url)
    queued = [key for key in client.scan_iter(f"{redis_prefix}*") if client.type(key) == b"list"]
    assert any(client.llen(key) for key in queued), queued  # the ingest task waits for a worker


def test_import_visbatch_from_the_clones_parent_folder(tmp_path):
    # Issue 31: from the folder holding a clone named visbatch, `import visbatch` found the clone's
    # folder (a namespace package without `run`); the install puts the package first (Makefile).
    import subprocess
    import sys

    (tmp_path / "visbatch").symlink_to(ROOT, target_is_directory=True)
    done = subprocess.run(
        [sys.executable, "-c", "import visbatch; print(visbatch.run.__module__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "visbatch.api", done.stderr
