"""A summary per source (issue 34, `--summarize`): once a source's answers are all in, one
text-only request over them gives one row per source; in stages when they do not fit the
model's context. On the tiny model, real SQLite, real files."""

from __future__ import annotations

import pytest

from ingest.spec import JobSpec, Sampling, SpecError, spec_from_fields
from storage import repository as repo
from storage.models import UnitStatus
from storage.summaries import SourceAnswer
from tests.media import write_pdf, write_video
from worker.drivers import embedded
from worker.drivers.embedded import run_job
from worker.runtime import Runtime
from worker.stages.generate import loop
from worker.stages.generate.summaries import answer_lines

pytestmark = pytest.mark.slow

SPEC = JobSpec(
    prompts=["What is on this page?"],
    summarize="What is this document about?",
    sampling=Sampling(max_new_tokens=6),
)


def _inputs(tmp_path, pages: int = 4):
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    write_pdf(folder / "doc.pdf", pages=pages)
    write_video(folder / "clip.mp4", seconds=3)
    return folder


def _summaries(rt: Runtime, job_id: str) -> list[dict]:
    return [r for r in repo.iter_results(rt.db, job_id) if r["scope"] == "source"]


def test_the_spec_refuses_an_empty_summary_prompt() -> None:
    with pytest.raises(SpecError, match="summarize: the summary's prompt must not be empty"):
        spec_from_fields({"prompts": ["q"], "summarize": "  "})


def test_the_summary_prompt_says_where_each_answer_is() -> None:
    spec = JobSpec(prompts=["Total?"], then=[["Vendor?"]], summarize="Sum up.")
    answers = (
        SourceAnswer(0, 0, None, None, 0, 0, "42 EUR", None),
        SourceAnswer(0, 0, None, None, 0, 1, "ACME", None),
        SourceAnswer(1, 2, None, None, 0, 0, None, "cut off"),  # a failed answer says nothing
    )
    assert answer_lines("pdf", answers, spec) == ["[page 1] Total?\n42 EUR", "[page 1] Vendor?\nACME"]
    video = (SourceAnswer(0, 3, 0.0, 3.0, 0, 0, "a cat", None),)
    assert answer_lines("video", video, spec) == ["[frames 0:00.000-0:03.000] Total?\na cat"]


@pytest.mark.parametrize("window", [None, "2"])
def test_one_summary_row_per_source_once_its_answers_are_in(settings_factory, tmp_path, window) -> None:
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [_inputs(tmp_path)], SPEC.model_copy(update={"window": window}))
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    assert summary["units_pending"] == 0 and not repo.units_in_state(rt.db, job_id, UnitStatus.ENCODED)
    rows = {r["source"].rsplit("/", 1)[-1]: r for r in _summaries(rt, job_id)}
    assert sorted(rows) == ["clip.mp4", "doc.pdf"]
    for name, last in (("doc.pdf", 3), ("clip.mp4", 2)):
        row = rows[name]
        assert (row["unit"], row["unit_to"], row["prompt_index"], row["turn"]) == (0, last, 1, 0)
        assert row["error"] is None and row["visual_tokens"] == 0 and row["prompt_tokens"] > 40
    # Exports say what it answers, and --by-document puts it first.
    from worker.results_export import asked, export_records, write_by_document

    spec = repo.job_state(rt.db, job_id)[1]
    records = list(export_records(repo.iter_results(rt.db, job_id), asked(spec)))
    [doc] = [r for r in records if r["scope"] == "source" and r["source"].endswith("doc.pdf")]
    assert doc["prompt"] == "What is this document about?" and (doc["page_from"], doc["page_to"]) == (1, 4)
    out = tmp_path / "docs"
    written = write_by_document(records, out, asked(spec), as_json=False, job_id=job_id)
    text = next(p for p in written if p.name.startswith("doc.pdf")).read_text()
    assert text.index("## Summary") < text.index("## Page 1" if window is None else "## Pages 1-2")


def test_answers_over_the_context_are_summarized_in_stages(settings_factory, tmp_path, monkeypatch) -> None:
    """A context of 400 tokens holds the prompt and a few answers: the summary is asked of parts,
    then of the parts' answers, and one row is stored."""
    monkeypatch.setattr(loop, "context_tokens", lambda adapter: 400)
    asked: list[int] = []
    rt = Runtime(settings_factory())
    real_add = type(rt.engine).add

    def add(self, request_id, request):
        if not request.images:  # a summary's request
            asked.append(len(request.prompt_ids))
        return real_add(self, request_id, request)

    monkeypatch.setattr(type(rt.engine), "add", add)
    spec = SPEC.model_copy(update={"sampling": Sampling(max_new_tokens=12)})
    job_id = run_job(rt, [_inputs(tmp_path, pages=8)], spec)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", ([e["message"] for e in summary["errors"]], asked)
    assert len(asked) >= 4 and max(asked) + 12 <= 400, asked  # parts of doc.pdf, then the whole
    assert len(_summaries(rt, job_id)) == 2 and all(r["error"] is None for r in _summaries(rt, job_id))


def test_a_stopped_job_gets_its_summaries_on_resume(settings_factory, tmp_path, monkeypatch) -> None:
    rt = Runtime(settings_factory())
    run = embedded.EmbeddedRun(rt)
    real = loop.GenerateLoop._summarize

    def stop_instead(self, answered):
        if any(w.spec.summarize for w in answered):
            run.request_stop("interrupted by SIGINT (Ctrl-C)")

    monkeypatch.setattr(loop.GenerateLoop, "_summarize", stop_instead)
    job_id = run.run([_inputs(tmp_path, pages=2)], SPEC)
    monkeypatch.setattr(loop.GenerateLoop, "_summarize", real)
    assert repo.job_state(rt.db, job_id)[0] == "cancelled" and not _summaries(rt, job_id)

    embedded.EmbeddedRun(Runtime(settings_factory())).resume(job_id)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    assert len(_summaries(rt, job_id)) == 2


def test_a_summary_is_text_even_in_a_schema_job() -> None:
    """The schema constrains each page's answer; the summary over them is plain text."""
    from storage.rows import UnitTask
    from storage.summaries import SourceTask
    from worker.engines.base import EngineRequest, Generation
    from worker.stages.generate.requests import Prepared, RequestBuilder

    spec = JobSpec(prompts=["Total?"], summarize="Sum up.", json_schema={"type": "object"})
    anchor = UnitTask(1, "job", 2, "a.pdf", "pdf", 0, "k", 10, 64, 64, None, None, None)
    task = SourceTask(anchor, 3, ())
    request = EngineRequest([1, 2, 3], (), "summary", max_new_tokens=8)
    builder = RequestBuilder(None, None, model_name="m", engine_name="e")  # row() needs neither
    row = builder.row(Prepared(task, spec, 1, request), Generation([5, 6], "Two invoices.", "stop"), 1.0)
    assert (row.scope, row.unit_to, row.prompt_index, row.error, row.text) == (
        "source",
        3,
        1,
        None,
        "Two invoices.",
    )


def test_the_review_page_shows_a_sources_summary_at_its_top(settings_factory, tmp_path) -> None:
    from worker.review.site import ReviewSite

    rt = Runtime(settings_factory())
    job_id = run_job(rt, [_inputs(tmp_path, pages=2)], SPEC.model_copy(update={"window": "2"}))
    pdf = next(r for r in _summaries(rt, job_id) if r["source"].endswith("doc.pdf"))
    units = repo.units_in_state(rt.db, job_id, UnitStatus.DONE)
    [source_id] = {u.source_id for u in units if u.source_uri.endswith("doc.pdf")}
    html = ReviewSite(rt.db, rt.store, job_id).source_page(source_id, "all", 1)
    assert html is not None and html.count("Summary: What is this document about?") == 1
    assert html.index('class="summary"') < html.index('class="unit"')  # above the pages
    assert "no answer yet" not in html  # page 2's answer is its window's, under page 1
    assert "answered in its window, under an earlier page" in html
    assert pdf["error"] is None
