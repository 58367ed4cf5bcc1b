"""Windows (issue 34, `--window`): several units of a source in one prompt, end to end on the
tiny model (real SQLite, real files, real transformers), and the window arithmetic alone."""

from __future__ import annotations

import pytest

from ingest.spec import JobSpec, Sampling, SpecError, spec_from_fields
from ingest.windows import WindowPlan, parse_window, windows_of
from storage import repository as repo
from storage.models import UnitStatus
from storage.windows import windows_containing
from tests.media import write_pdf, write_video
from worker.drivers.embedded import run_job
from worker.runtime import Runtime

pytestmark = pytest.mark.budget(
    150, reason="~15 whole jobs of windows on the tiny models (one of them LLaVA-OneVision), one on a fleet"
)

# --- the arithmetic -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "plan"),
    [
        ("3", WindowPlan(size=3, stride=3)),
        ("3:1", WindowPlan(size=3, stride=1)),
        (" ALL ", WindowPlan()),
        ("10s", WindowPlan(seconds=10.0, stride_seconds=10.0)),
        ("10s:2.5s", WindowPlan(seconds=10.0, stride_seconds=2.5)),
    ],
)
def test_parse(text: str, plan: WindowPlan) -> None:
    assert parse_window(text) == plan


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("0", "1 to 10,000 units, not 0"),
        ("2:3", "stride 3 must be 1 to 2"),
        ("5s:6s", "stride 6s"),
        ("0s", "not 0 s"),
        ("3:2s", "not a window"),
        ("pages", "not a window"),
    ],
)
def test_parse_refuses(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_window(text)


def test_spec_names_the_field() -> None:
    with pytest.raises(SpecError, match="window: .*stride"):
        spec_from_fields({"prompts": ["q"], "window": "2:5"})


def test_count_windows_cover_every_unit_and_stop_at_the_end() -> None:
    n = [None] * 7
    assert windows_of(parse_window("3"), n) == [(0, 2), (3, 5), (6, 6)]
    assert windows_of(parse_window("3:2"), n) == [(0, 2), (2, 4), (4, 6)]
    assert windows_of(parse_window("4:2"), n) == [(0, 3), (2, 5), (4, 6)]
    assert windows_of(parse_window("10"), n) == [(0, 6)]
    assert windows_of(parse_window("all"), n) == [(0, 6)]
    assert windows_of(parse_window("1"), [None]) == [(0, 0)]  # a one-image source: a window of one
    # While the source is still being split, a window cut short by the end is not known yet.
    assert windows_of(parse_window("3"), n, complete=False) == [(0, 2), (3, 5)]
    assert windows_of(parse_window("3:2"), [None] * 6, complete=False) == [(0, 2), (2, 4)]
    assert windows_of(parse_window("all"), n, complete=False) == []


def test_time_windows() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.5]
    assert windows_of(parse_window("2s"), times) == [(0, 1), (2, 3), (4, 5), (6, 6)]
    assert windows_of(parse_window("4s:2s"), times) == [(0, 3), (2, 5), (4, 6)]
    assert windows_of(parse_window("4s:2s"), times, complete=False) == [(0, 3), (2, 5)]
    # A span with no frame in it is no window.
    assert windows_of(parse_window("1s"), [0.0, 3.0]) == [(0, 0), (1, 1)]


def test_windows_containing() -> None:
    windows = [(0, 2), (2, 4), (4, 6)]
    assert windows_containing(windows, {2}) == [(0, 2), (2, 4)]
    assert windows_containing(windows, {5, 6}) == [(4, 6)]
    assert windows_containing(windows, set()) == []


# --- end to end -----------------------------------------------------------------------------

SPEC = JobSpec(
    prompts=["What is on these pages?", "Is there a table? Answer yes or no."],
    sampling=Sampling(max_new_tokens=4),
    window="2",
)


@pytest.mark.slow
def test_pdf_and_video_windows_end_to_end(settings_factory, tmp_path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "invoice.pdf", pages=5)
    write_video(inputs / "clip.mp4", seconds=3)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [inputs], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary["errors"]
    rows = list(repo.iter_results(rt.db, job_id))
    spans = sorted({(r["source"].rsplit("/", 1)[-1], r["unit"], r["unit_to"]) for r in rows})
    assert spans == [
        ("clip.mp4", 0, 1),
        ("clip.mp4", 2, 2),
        ("invoice.pdf", 0, 1),
        ("invoice.pdf", 2, 3),
        ("invoice.pdf", 4, 4),
    ]
    assert {r["scope"] for r in rows} == {"window"} and {r["turn"] for r in rows} == {0}
    assert len(rows) == 5 * len(SPEC.prompts) and all(r["error"] is None for r in rows)
    # Each page and frame encoded once however many windows show it.
    assert (summary["cache_hits"], summary["cache_misses"]) == (0, 8)
    # A window's answer counts the visual tokens of all its units.
    done = repo.units_in_state(rt.db, job_id, UnitStatus.DONE)
    per_unit = {(u.source_uri, u.index): u.visual_tokens for u in done}
    first = next(r for r in rows if r["source"].endswith("invoice.pdf") and r["unit"] == 0)
    pdf = next(uri for uri, _ in per_unit if uri.endswith("invoice.pdf"))
    assert first["visual_tokens"] == per_unit[(pdf, 0)] + per_unit[(pdf, 1)]


# --- the fleet ------------------------------------------------------------------------------


@pytest.fixture
def fleet(tmp_path, tiny_model_dir, postgres_url):
    from tests.fleet_harness import Fleet

    f = Fleet(tmp_path, tiny_model_dir, postgres_url)
    yield f
    f.kill_all()
    f.close()


def _spans(db, job_id: str) -> list[tuple[str, int, int | None, int, str, int]]:
    rows = repo.iter_results(db, job_id)
    return sorted(
        (r["source"].rsplit("/", 1)[-1], r["unit"], r["unit_to"], r["prompt_index"], r["scope"], r["turn"])
        for r in rows
    )


@pytest.mark.slow
@pytest.mark.fleet
@pytest.mark.usefixtures("redis_url")
def test_windows_on_a_fleet(fleet, tmp_path) -> None:
    """Real `visbatch worker` processes (two GPU workers, so windows span encode messages
    handled by different workers): every window answered once per prompt, every unit done."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "report.pdf", pages=7)
    write_pdf(inputs / "memo.pdf", pages=1)
    fleet.set(VISBATCH_ENCODE_CHUNK_UNITS="2")  # a window's pages in several encode messages
    fleet.start_worker("ingest")
    fleet.start_worker("encode,generate")
    fleet.start_worker("encode,generate")
    job = fleet.submit(
        str(inputs), "-p", "What is here?", "-p", "Any table?", "--window", "3:2", "--max-new-tokens", "3",
        "--summarize", "What is this document about?",
    )  # fmt: skip
    fleet.wait([job])
    assert fleet.status(job) == "succeeded", fleet.logs()
    expected = [("memo.pdf", 0, 0, p, "window", 0) for p in (0, 1)] + [("memo.pdf", 0, 0, 2, "source", 0)]
    expected += [("report.pdf", a, b, p, "window", 0) for a, b in ((0, 2), (2, 4), (4, 6)) for p in (0, 1)]
    expected += [("report.pdf", 0, 6, 2, "source", 0)]  # its summary, once its windows are in
    assert _spans(fleet.db, job) == sorted(expected)
    summary = repo.job_summary(fleet.db, job)
    assert (summary["units_total"], summary["units_pending"], summary["units_failed"]) == (8, 0, 0), summary
    assert (summary["results"], summary["cache_misses"]) == (10, 8), summary


# --- failures, resume, reruns, refusals ----------------------------------------------------


def _inputs(tmp_path, pages: int = 4):
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    write_pdf(folder / "doc.pdf", pages=pages)
    return folder


@pytest.mark.slow
def test_a_failed_page_fails_its_windows_with_its_cause(settings_factory, tmp_path, monkeypatch) -> None:
    """Page 2 cannot be encoded: its window answers with page 2's error, the other window is
    asked, every page ends done or failed and the job ends partial."""
    from worker.drivers import embedded

    real = embedded.encode_units

    def encode_units(rt, units, spec):
        bad = [u for u in units if u.index == 1]
        step = real(rt, [u for u in units if u.index != 1], spec)
        if bad:
            repo.close_finished(
                rt.db, repo.fail_units(rt.db, [(u.unit_id, "the page is unreadable") for u in bad])
            )
            step.failed += len(bad)
        return step

    monkeypatch.setattr(embedded, "encode_units", encode_units)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [_inputs(tmp_path)], SPEC)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "partial", summary
    assert (summary["units_failed"], summary["units_pending"]) == (1, 0), summary
    rows = {(r["unit"], r["prompt_index"]): r for r in repo.iter_results(rt.db, job_id)}
    assert sorted(rows) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert rows[0, 0]["error"] == "page 2 failed: the page is unreadable" and rows[0, 0]["unit_to"] == 1
    assert rows[2, 0]["error"] is None and rows[2, 0]["unit_to"] == 3


@pytest.mark.slow
def test_a_stopped_windowed_job_resumes_without_asking_a_window_twice(
    settings_factory, tmp_path, monkeypatch
) -> None:
    from worker.drivers import embedded

    folder = _inputs(tmp_path, pages=6)
    spec = SPEC.model_copy(update={"window": "2:1"})  # 5 windows over 6 pages, overlapping
    # One window's two prompts in flight at a time: the first write holds one window's answers.
    rt = Runtime(settings_factory(generate_window=2))
    run = embedded.EmbeddedRun(rt)
    real = repo.store_results

    def stop_after_first_write(*args, **kwargs):
        stored = real(*args, **kwargs)
        run.request_stop("interrupted by SIGINT (Ctrl-C)")
        return stored

    monkeypatch.setattr(repo, "store_results", stop_after_first_write)
    job_id = run.run([folder], spec)
    monkeypatch.setattr(repo, "store_results", real)
    assert repo.job_state(rt.db, job_id)[0] == "cancelled"
    before = {(r["unit"], r["prompt_index"]) for r in repo.iter_results(rt.db, job_id) if r["error"] is None}
    assert 0 < len(before) < 5 * 2

    resumed = embedded.EmbeddedRun(Runtime(settings_factory()))
    resumed.resume(job_id)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    spans = sorted((r["unit"], r["unit_to"], r["prompt_index"]) for r in repo.iter_results(rt.db, job_id))
    assert spans == [(a, a + 1, p) for a in range(5) for p in (0, 1)]
    assert resumed.work_done()["answers"] == 5 * 2 - len(before)  # nothing asked twice


@pytest.mark.slow
def test_a_warm_rerun_with_other_windows_encodes_nothing(settings_factory, tmp_path) -> None:
    folder = _inputs(tmp_path, pages=5)
    first = Runtime(settings_factory())
    run_job(first, [folder], SPEC)
    second = Runtime(settings_factory())
    job_id = run_job(second, [folder], SPEC.model_copy(update={"window": "3:1"}))
    summary = repo.job_summary(second.db, job_id)
    assert summary["status"] == "succeeded", summary
    assert (summary["cache_hits"], summary["cache_misses"]) == (5, 0)
    assert second.token_store.stats.tower_calls == 0
    assert sorted({(r["unit"], r["unit_to"]) for r in repo.iter_results(second.db, job_id)}) == [
        (0, 2),
        (1, 3),
        (2, 4),
    ]


def test_a_time_window_over_a_pdf_is_refused_before_the_job_starts(tmp_path, monkeypatch) -> None:
    import visbatch

    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    folder = _inputs(tmp_path, pages=1)
    says = r"doc\.pdf: --window 10s counts seconds of video, and this is a PDF"
    with pytest.raises(visbatch.Error, match=says):
        visbatch.run([folder], prompts=["q"], window="10s", model=str(tmp_path / "no-model"))
    with pytest.raises(visbatch.Error, match="window='2:3': the stride 3 must be 1 to 2"):
        visbatch.run([folder], prompts=["q"], window="2:3", model=str(tmp_path / "no-model"))


def test_plan_refuses_what_run_and_submit_refuse(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Before: `plan doc.pdf --window 10s` printed a plan of one request for a PDF (exit 0) that
    `run` then refused. Now plan refuses it before any figure, as run does, and so the misuses of
    --drop-static; nothing is written to stdout."""
    from typer.testing import CliRunner

    from worker.cli.main import app

    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    folder = _inputs(tmp_path, pages=2)
    common = [str(folder), "--model", str(tiny_model_dir), "-p", "q"]
    for extra, says in (
        (["--window", "10s"], "doc.pdf: --window 10s counts seconds of video, and this is a PDF"),
        (["--drop-static", "0.1"], "--drop-static 0.1: it drops what did not change"),
        (["--window", "2", "--drop-static", "0.1", "--prune-keep", "0.5"], "with --prune-keep or --merge"),
    ):
        result = CliRunner().invoke(app, ["plan", *common, *extra])
        assert result.exit_code == 2 and says in result.stderr, result.output
        assert result.stdout == "", result.stdout
    assert not (tmp_path / "home").exists()


def test_the_result_rows_view_says_what_a_window_covers(db) -> None:
    from sqlalchemy import text

    from storage.rows import ResultRow, UnitRow

    job_id = repo.create_job(db, JobSpec(prompts=["q"], window="2"))
    pdf = repo.add_source(db, job_id, "s3://in/a.pdf")
    repo.complete_source(db, pdf, kind="pdf", sha256="a" * 64, size=1)
    pages = repo.add_units(db, job_id, pdf, [UnitRow(i, 10, 10, f"p{i}.png", 4) for i in range(3)])
    video = repo.add_source(db, job_id, "s3://in/b.mp4")
    repo.complete_source(db, video, kind="video", sha256="b" * 64, size=1)
    frames = repo.add_units(
        db, job_id, video, [UnitRow(i, 10, 10, f"f{i}.png", 4, timestamp=i * 2.5) for i in range(3)]
    )
    common = dict(
        prompt_index=0, output=None, text="x", error=None, prompt_tokens=1, visual_tokens=8,
        completion_tokens=1, finish_reason="stop", model="m", engine="e", cache_hit=False, latency_ms=1.0,
    )  # fmt: skip
    rows = [
        ResultRow(unit_id=pages[0], scope="window", unit_to=1, **common),
        ResultRow(unit_id=pages[2], scope="window", unit_to=2, **common),
        ResultRow(unit_id=frames[0], scope="window", unit_to=2, **common),
    ]
    repo.upsert_results(db, job_id, rows)
    sql = text(
        "SELECT source_uri, scope, unit_from, unit_to, page_from, page_to, time_from, time_to, turn,"
        " page_number, unit_index FROM result_rows WHERE job_id = :job ORDER BY source_uri, unit_from"
    )
    with db.engine.connect() as connection:
        got = [tuple(row) for row in connection.execute(sql, {"job": job_id})]
    assert got == [
        ("s3://in/a.pdf", "window", 0, 1, 1, 2, None, None, 0, 1, 0),
        ("s3://in/a.pdf", "window", 2, 2, 3, 3, None, None, 0, 3, 2),
        ("s3://in/b.mp4", "window", 0, 2, None, None, 0.0, 5.0, 0, None, 0),
    ]
    exported = [(r["unit"], r["unit_to"], r["timestamp_to"]) for r in repo.iter_results(db, job_id)]
    assert exported == [(0, 1, None), (2, 2, None), (0, 2, 5.0)]


def test_a_window_over_the_models_context_is_refused_by_plan_and_run(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model's context is 32,768 tokens: a whole 5-page PDF in one window with 32,000
    new tokens does not fit; `plan` and `run` say so (exit 2) with the tokens, the limit and the
    fixes, and nothing runs."""
    from typer.testing import CliRunner

    from worker.cli.main import app

    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    folder = _inputs(tmp_path, pages=5)
    args = [str(folder), "--model", str(tiny_model_dir), "--window", "all", "--max-new-tokens", "32000"]
    for command in (["plan"], ["run", "-p", "Total?"]):
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 2, result.output
        assert "doc.pdf: a window of its pages or frames is" in result.output
        assert (
            "over the model's context of 32,768 tokens" in result.output and "--detail low" in result.output
        )
    assert CliRunner().invoke(app, ["plan", *args[:-1], "4"]).exit_code == 0
    assert "visual_to_lm" in CliRunner().invoke(app, ["plan", *args[:-1], "4", "--json"]).output


@pytest.mark.slow
def test_llava_onevision_windows_show_each_page_on_its_window_view(
    settings_factory, family_model_dir, tmp_path
) -> None:
    """LLaVA-OneVision's processor shows each image of a several-image prompt on one square view
    (test_several_images checks the tokens against it): a window of several pages is asked with
    each page's window view, a second cache entry the encode stage makes beside the usual one; a
    window of one page shows the usual view. Plan == spent; a warm rerun encodes nothing."""
    from worker.planning.planner import load_plan_model, plan_job

    llava = str(family_model_dir("llava_onevision"))
    folder = _inputs(tmp_path, pages=3)  # windows: pages 1-2, then page 3 alone
    spec = SPEC.model_copy(update={"then": [["And the total?"], []]})
    planned = plan_job([folder], spec, load_plan_model(llava)).total
    rt = Runtime(settings_factory(model=llava))
    job_id = run_job(rt, [folder], spec)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    units = {u.index: u for u in repo.units_in_state(rt.db, job_id, UnitStatus.DONE)}
    view = rt.adapter.token_rule.window_view_tokens
    rows = list(repo.iter_results(rt.db, job_id))
    assert len(rows) == 2 * 3 and all(r["error"] is None for r in rows)
    assert {(r["unit"], r["unit_to"], r["visual_tokens"]) for r in rows} == {
        (0, 1, 2 * view),
        (2, 2, units[2].visual_tokens),
    }
    assert units[2].visual_tokens != view  # the usual (AnyRes) view, not the window's
    assert planned.requests == len(rows)
    assert planned.visual_to_lm == summary["tokens"]["spent"]["visual_to_lm"]
    assert planned.visual_tokens == summary["visual_tokens"]
    assert rt.token_store.stats.images_encoded == 2 * 3  # each page once on each view
    again = run_job(rt, [folder], spec)
    assert repo.job_summary(rt.db, again)["status"] == "succeeded"
    assert rt.token_store.stats.images_encoded == 2 * 3  # warm: both views from the cache
    # `visbatch purge` of both jobs deletes each page's window view with its usual entry.
    from storage import retention
    from storage.keys import window_view_key

    keys = [u.cache_key for u in units.values()]
    assert all(rt.token_store.cache.get(window_view_key(k)) is not None for k in keys)
    retention.purge_jobs(rt.db, [job_id, again], delete_entries=retention.cache_deleter(rt.token_store.cache))
    assert all(
        rt.token_store.cache.get(k) is None and rt.token_store.cache.get(window_view_key(k)) is None
        for k in keys
    )


@pytest.mark.slow
def test_the_review_page_shows_a_windows_answer_over_a_strip_of_its_pages(settings_factory, tmp_path) -> None:
    from worker.review.site import ReviewSite

    rt = Runtime(settings_factory())
    spec = SPEC.model_copy(update={"then": [["And the total?"], []]})
    job_id = run_job(rt, [_inputs(tmp_path, pages=3)], spec)
    [source_id] = {u.source_id for u in repo.units_in_state(rt.db, job_id, UnitStatus.DONE)}
    units = {u.index: u.unit_id for u in repo.units_in_state(rt.db, job_id, UnitStatus.DONE)}
    html = ReviewSite(rt.db, rt.store, job_id).source_page(source_id, "all", 1)
    assert html is not None
    first = html.split('data-from="0" data-to="1"', 1)[1].split("</div></div>", 1)[0]
    assert "Pages 1-2" in first
    assert f'src="thumb/{units[0]}.jpg"' in first and f'src="thumb/{units[1]}.jpg"' in first
    assert f'src="thumb/{units[2]}.jpg"' not in first
    assert 'data-from="2" data-to="2"' in html  # the last window: page 3 alone
    assert "Q1, follow-up 1: And the total?" in html and "Q2: Is there a table?" in html


def test_runs_first_answers_show_a_follow_up_under_its_own_question(settings_factory, tmp_path) -> None:
    """The end of `visbatch run`: each turn under its own question, not a window's follow-up
    shown as if it were the next window of the first prompt."""
    from io import StringIO

    from rich.console import Console

    from storage.jobs import preview_per_source
    from worker.cli.output import print_preview

    rt = Runtime(settings_factory())
    spec = SPEC.model_copy(update={"then": [["And the total?"], []]})
    job_id = run_job(rt, [_inputs(tmp_path, pages=3)], spec)
    out = StringIO()
    print_preview(Console(file=out, width=80), spec.prompts, spec.then, preview_per_source(rt.db, job_id))
    lines = out.getvalue().splitlines()
    assert lines[1:] == [
        '  "What is on these pages?"',
        f"    doc.pdf pages 1-2: {lines[2].split(': ', 1)[1]}",
        f"    doc.pdf page 3: {lines[3].split(': ', 1)[1]}",
        '  "And the total?" (follow-up 1)',
        f"    doc.pdf pages 1-2: {lines[5].split(': ', 1)[1]}",
        f"    doc.pdf page 3: {lines[6].split(': ', 1)[1]}",
        '  "Is there a table? Answer yes or no."',
        f"    doc.pdf pages 1-2: {lines[8].split(': ', 1)[1]}",
        f"    doc.pdf page 3: {lines[9].split(': ', 1)[1]}",
    ], lines


@pytest.mark.slow
def test_compare_matches_windows_by_range_and_turn(settings_factory, tmp_path) -> None:
    from worker.review.compare import compare_jobs

    folder = _inputs(tmp_path, pages=4)
    spec = SPEC.model_copy(update={"then": [["And the total?"], []]})
    rt = Runtime(settings_factory())
    first, second = run_job(rt, [folder], spec), run_job(rt, [folder], spec)
    paged = run_job(rt, [folder], spec.model_copy(update={"window": None}))
    same = compare_jobs(rt.db, first, second)
    # Prompt 1: 2 windows x 2 turns; prompt 2: 2 windows. Greedy on one model: all agree.
    assert [(p.compared, p.agree) for p in same.prompts] == [(4, 4), (2, 2)]
    # Windows against pages: no answer covers the same pages, so none is compared as alike.
    other = compare_jobs(rt.db, first, paged)
    assert all(p.agree == 0 for p in other.prompts)


@pytest.mark.slow
def test_time_windows_over_a_video(settings_factory, tmp_path) -> None:
    """`--window 2s:1s` over 4 frames sampled at 1 fps: spans [0, 2), [1, 3), [2, 4) seconds."""
    folder = tmp_path / "in"
    folder.mkdir()
    write_video(folder / "clip.mp4", seconds=4)
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], SPEC.model_copy(update={"window": "2s:1s"}))
    assert repo.job_summary(rt.db, job_id)["status"] == "succeeded"
    rows = [r for r in repo.iter_results(rt.db, job_id) if r["prompt_index"] == 0]
    assert [(r["unit"], r["unit_to"], r["timestamp"], r["timestamp_to"]) for r in rows] == [
        (0, 1, 0.0, 1.0),
        (1, 2, 1.0, 2.0),
        (2, 3, 2.0, 3.0),
    ]


def test_static_patches_dropped_with_pruning_or_merging_are_refused(tmp_path, monkeypatch) -> None:
    import visbatch

    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    folder = _inputs(tmp_path, pages=2)
    for option in ({"prune_keep": 0.5}, {"merge_keep": 0.5}):
        with pytest.raises(visbatch.Error, match="--drop-static 0.1 with --prune-keep or --merge-keep"):
            visbatch.run(
                [folder],
                prompts=["q"],
                window="2",
                drop_static=0.1,
                model=str(tmp_path / "no-model"),
                **option,
            )


@pytest.mark.slow
def test_plan_counts_what_the_run_spends(settings_factory, tiny_model_dir, tmp_path) -> None:
    """`plan` before the run: requests (windows x questions, plus a summary per source) and the
    visual tokens the LM is given are what the run then stores and counts."""
    from worker.planning.planner import load_plan_model, plan_job

    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=5)
    write_video(folder / "clip.mp4", seconds=3)
    spec = SPEC.model_copy(update={"window": "2", "then": [["And?"], []], "summarize": "Sum up."})
    planned = plan_job([folder], spec, load_plan_model(str(tiny_model_dir))).total
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], spec)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    assert planned.requests == summary["results"] + summary["results_failed"]
    assert planned.visual_to_lm == summary["tokens"]["spent"]["visual_to_lm"]
    assert planned.visual_tokens == summary["visual_tokens"]
