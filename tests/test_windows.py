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
        str(inputs), "-p", "What is here?", "-p", "Any table?", "--window", "3:2", "--max-new-tokens", "3"
    )
    fleet.wait([job])
    assert fleet.status(job) == "succeeded", fleet.logs()
    expected = [("memo.pdf", 0, 0, p, "window", 0) for p in (0, 1)]
    expected += [("report.pdf", a, b, p, "window", 0) for a, b in ((0, 2), (2, 4), (4, 6)) for p in (0, 1)]
    assert _spans(fleet.db, job) == expected
    summary = repo.job_summary(fleet.db, job)
    assert (summary["units_total"], summary["units_pending"], summary["units_failed"]) == (8, 0, 0), summary
    assert (summary["results"], summary["cache_misses"]) == (8, 8), summary
