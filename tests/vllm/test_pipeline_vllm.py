"""The embedded pipeline with VISBATCH_ENGINE=vllm: the same results as with transformers.

The settings match the session's engine (tests/vllm/conftest.py), so the runtime reuses the
session's vllm.LLM (one per process) instead of starting a second one.
"""

from __future__ import annotations

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from tests.media import write_pdf, write_video
from tests.vllm.conftest import TEST_OPTIONS
from tests.vllm.helpers import SCHEMA, answers
from worker.drivers.embedded import run_job
from worker.runtime import Runtime

SPEC = JobSpec(
    prompts=["What is on this page?", "Is there a table? Answer yes or no."],
    sampling=Sampling(max_new_tokens=6),
)


def _results(rt: Runtime, job_id: str) -> dict:
    return {(r["source"], r["unit"], r["prompt_index"]): r for r in repo.iter_results(rt.db, job_id)}


def _run(settings_factory, monkeypatch, home, inputs, spec: JobSpec, engine: str, model_dir) -> tuple:
    vllm_env = {f"VISBATCH_VLLM_{k.upper()}": str(v) for k, v in TEST_OPTIONS.items()}
    for key, value in vllm_env.items():
        monkeypatch.setenv(key, value)
    rt = Runtime(settings_factory(home=home, engine=engine, device="cpu", model=str(model_dir)))
    job_id = run_job(rt, [inputs], spec)
    return rt, job_id


def test_pipeline_with_vllm_equals_transformers(
    vllm_engine, vllm_model_dir, settings_factory, monkeypatch, tmp_path
):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "invoice.pdf", pages=2)
    write_video(inputs / "clip.mp4", seconds=2)

    hf_rt, hf_job = _run(
        settings_factory, monkeypatch, tmp_path / "hf", inputs, SPEC, "transformers", vllm_model_dir
    )
    rt, job = _run(settings_factory, monkeypatch, tmp_path / "vllm", inputs, SPEC, "vllm", vllm_model_dir)
    assert rt.engine.llm is vllm_engine.llm  # one LLM per process

    summary = repo.job_summary(rt.db, job)
    assert summary["status"] == "succeeded", summary["errors"]
    got, want = _results(rt, job), _results(hf_rt, hf_job)
    assert got.keys() == want.keys() and len(got) == (2 + 2) * len(SPEC.prompts)
    for key, row in got.items():
        assert row["engine"] == "vllm" and want[key]["engine"] == "transformers"
        for column in ("text", "completion_tokens", "finish_reason", "prompt_tokens", "visual_tokens"):
            assert row[column] == want[key][column], (key, column)


def test_pipeline_json_schema_with_vllm(vllm_engine, vllm_model_dir, settings_factory, monkeypatch, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "invoice.pdf", pages=2)
    spec = JobSpec(prompts=["Extract the fields."], json_schema=SCHEMA, sampling=Sampling(max_new_tokens=64))
    rt, job = _run(settings_factory, monkeypatch, tmp_path / "vllm", inputs, spec, "vllm", vllm_model_dir)
    summary = repo.job_summary(rt.db, job)
    assert summary["status"] == "succeeded", summary["errors"]
    rows = list(repo.iter_results(rt.db, job))
    assert len(rows) == 2
    for row in rows:
        assert row["error"] is None and set(row["output"]) == {"label", "count", "ok"}
        assert row["finish_reason"] == "stop" and row["completion_tokens"] > 0


def test_windows_turns_and_summaries_with_vllm_equal_transformers(
    vllm_engine, vllm_model_dir, settings_factory, monkeypatch, tmp_path
):
    """Issue 34's options on the vLLM engine: pages in windows of two, a video's frames in one,
    a follow-up turn, and a summary per source: every row the transformers engine's."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "invoice.pdf", pages=3)
    write_video(inputs / "clip.mp4", seconds=2)
    spec = SPEC.model_copy(update={"window": "2", "then": [["And the date?"], []], "summarize": "Summarize."})
    run = [
        _run(settings_factory, monkeypatch, tmp_path / engine, inputs, spec, engine, vllm_model_dir)
        for engine in ("transformers", "vllm")
    ]
    (hf_rt, hf_job), (rt, job) = run
    summary = repo.job_summary(rt.db, job)
    assert summary["status"] == "succeeded", summary["errors"]
    got, want = answers(rt.db, job), answers(hf_rt.db, hf_job)
    # 3 windows (pages 1-2, page 3 ending the PDF's; the clip's 2 frames) x (2 prompts + 1
    # follow-up), and a summary per source.
    assert got.keys() == want.keys() and len(got) == 3 * 3 + 2
    assert {key[-1] for key in got} == {"window", "source"}
    for key, row in got.items():
        assert row["engine"] == "vllm" and row["error"] is None, (key, row["error"])
        for column in ("text", "completion_tokens", "finish_reason", "prompt_tokens", "visual_tokens"):
            assert row[column] == want[key][column], (key, column)
