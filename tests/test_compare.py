"""`visbatch compare` on real jobs (tiny model): --detail high against low over the same PDF and
video, and two JSON runs where one answer is then changed and one failed through SQL, so the
expected figures are known exactly. The expected figures are counted here from the jobs' result
rows (repository.iter_results), not through storage.review."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from sqlalchemy import select, update

from ingest.budget import VisualBudget
from ingest.spec import IngestOptions, JobSpec, Sampling
from storage import repository as repo
from storage.db import Database
from storage.models import RESULTS, SOURCES, UNITS
from storage.review import iter_unit_pairs
from tests.browser import chromium, load_all_images
from tests.media import write_pdf, write_video
from tests.review_jobs import make_job, run_cli
from visbatch.settings import Settings
from worker.review.compare import CompareError, compare_jobs, compare_json, leaves, terminal_safe

pytestmark = pytest.mark.slow

TEXT_PROMPTS = ["Describe the page.", "Is there a table? Answer yes or no."]
# The tiny random model answers greedily with one repeated byte whatever the detail; sampled
# (seeded, so reproducible) its answers move with its input, as a real model's would.
SAMPLED = Sampling(max_new_tokens=8, temperature=1.0, seed=3)
LOW_CAP = 256  # --detail low: at most 256 visual tokens per page or frame


def _spec(detail: str, prompts=TEXT_PROMPTS, **extra) -> JobSpec:
    return JobSpec(
        prompts=prompts,
        sampling=extra.pop("sampling", SAMPLED),
        ingest=IngestOptions(longest_side=896),
        budget=VisualBudget(detail=detail),
        **extra,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("compare")
    inputs = root / "in"
    inputs.mkdir()
    paths = [write_pdf(inputs / "invoice.pdf", pages=3), write_video(inputs / "clip.mp4", seconds=2)]
    settings = Settings(home=root / "home", model=str(tiny_model_dir))
    high = make_job(settings, paths, _spec("high"))
    low = make_job(settings, paths, _spec("low"))
    db = Database(settings.sqlalchemy_url())
    yield settings, db, paths, high, low
    db.dispose()


def _answers(db: Database, job_id: str) -> dict[tuple[str, int, int], dict]:
    return {(r["source"], r["unit"], r["prompt_index"]): r for r in repo.iter_results(db, job_id)}


def _unit_tokens(db: Database, job_id: str) -> dict[tuple[str, int], int]:
    return {(r["source"], r["unit"]): r["visual_tokens"] for r in repo.iter_results(db, job_id)}


def test_detail_high_against_low(world):
    settings, db, paths, high, low = world
    c = compare_jobs(db, high, low)
    a, b = _answers(db, high), _answers(db, low)
    assert set(a) == set(b) and len(a) == 5 * len(TEXT_PROMPTS)  # 3 pages + 2 frames, every answer ok

    # Agreement per prompt, exactly as counted from the rows.
    for i, p in enumerate(c.prompts):
        assert (p.prompt, p.index_a, p.index_b) == (TEXT_PROMPTS[i], i, i)
        same = [a[k]["text"].strip() == b[k]["text"].strip() for k in a if k[2] == i]
        assert (p.units, p.compared, p.agree, p.differ) == (5, 5, sum(same), len(same) - sum(same))
        assert p.rate == sum(same) / 5 and p.json_pairs == 0 and not p.fields
        assert p.failed_a == p.failed_b == p.missing_a == p.missing_b == 0
    differing = {(s, u) for (s, u, i), r in a.items() if r["text"].strip() != b[(s, u, i)]["text"].strip()}
    assert {(d.uri, d.unit_index) for d in c.pages} == differing and c.differing_units == len(differing)
    for d in c.pages:
        for answer in d.answers:
            i = TEXT_PROMPTS.index(answer.prompt)
            assert (answer.text_a, answer.text_b) == (
                a[(d.uri, d.unit_index, i)]["text"],
                b[(d.uri, d.unit_index, i)]["text"],
            )

    # What changed, and what did not: low caps every page at 256 tokens; 320x240 frames (99) are
    # under both caps.
    tokens_high, tokens_low = _unit_tokens(db, high), _unit_tokens(db, low)
    pdf, video = str(paths[0]), str(paths[1])
    assert all(tokens_high[(pdf, n)] > LOW_CAP >= tokens_low[(pdf, n)] for n in range(3))
    assert all(tokens_high[(video, n)] == tokens_low[(video, n)] == 99 for n in range(2))
    assert c.visual_tokens_shared == (sum(tokens_high.values()), sum(tokens_low.values()))
    assert c.job_a.tokens["spent"]["visual"] == sum(tokens_high.values())
    assert (c.units_shared, c.units_only_a, c.units_only_b, c.sources_shared) == (5, 0, 0, 2)
    assert differing, "the low-detail pages gave the same answers: this test would prove little"


def test_known_differences_in_json_answers(world):
    """Same inputs and prompts (given in another order): the runs agree everywhere; then one JSON
    field of one answer is flipped and one answer failed through SQL, and exactly those show."""
    settings, db, paths, _, _ = world
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["invoice", "other"]}, "has_table": {"type": "boolean"}},
        "required": ["kind", "has_table"],
        "additionalProperties": False,
    }
    prompts = ["Classify.", "What kind of page?"]
    json_spec = dict(json_schema=schema, sampling=Sampling(max_new_tokens=40))
    job_a = make_job(settings, paths, _spec("high", prompts, **json_spec))
    job_b = make_job(settings, paths, _spec("high", prompts[::-1], **json_spec))
    before = compare_jobs(db, job_a, job_b)
    assert [(p.prompt, p.index_a, p.index_b) for p in before.prompts] == [
        (prompts[0], 0, 1),
        (prompts[1], 1, 0),
    ]
    for p in before.prompts:
        assert (p.json_pairs, p.compared, p.agree) == (5, 5, 5)
        assert {k: (f.compared, f.agree) for k, f in p.fields.items()} == {
            "kind": (5, 5),
            "has_table": (5, 5),
        }
    assert before.differing_units == 0 and before.pages == []

    pdf, video = str(paths[0]), str(paths[1])
    with db.session() as session:
        changed_id, output = _result(session, job_b, pdf, 1, prompt_index=1)  # B asks "Classify." second
        flipped = dict(output, kind="other" if output["kind"] == "invoice" else "invoice")
        session.execute(
            update(RESULTS).where(RESULTS.c.id == changed_id).values(output=flipped, text=json.dumps(flipped))
        )
        failed_id, _ = _result(session, job_b, video, 0, prompt_index=0)
        session.execute(
            update(RESULTS).where(RESULTS.c.id == failed_id).values(output=None, text=None, error="boom")
        )

    after = compare_jobs(db, job_a, job_b)
    classify, kind = after.prompts
    assert (classify.compared, classify.agree, classify.differ, classify.rate) == (5, 4, 1, 0.8)
    assert {k: (f.compared, f.agree) for k, f in classify.fields.items()} == {
        "kind": (5, 4),
        "has_table": (5, 5),
    }
    assert (kind.units, kind.compared, kind.agree, kind.failed_b, kind.failed_a) == (5, 4, 4, 1, 0)
    assert after.differing_units == 2
    failed, changed = after.pages  # in (uri, unit) order: clip.mp4 before invoice.pdf
    assert (failed.uri, failed.unit_index, [x.outcome for x in failed.answers]) == (video, 0, ["failed_b"])
    assert (failed.answers[0].prompt, failed.answers[0].error_b) == (prompts[1], "boom")
    assert (changed.uri, changed.unit_index) == (pdf, 1)
    [answer] = changed.answers
    assert (answer.outcome, answer.fields, answer.output_b) == ("differ", ["kind"], flipped)


def _result(session, job_id: str, uri: str, unit: int, prompt_index: int) -> tuple[int, dict]:
    row = session.execute(
        select(RESULTS.c.id, RESULTS.c.output)
        .join(UNITS, UNITS.c.id == RESULTS.c.unit_id)
        .join(SOURCES, SOURCES.c.id == UNITS.c.source_id)
        .where(
            RESULTS.c.job_id == job_id,
            SOURCES.c.uri == uri,
            UNITS.c.unit_index == unit,
            RESULTS.c.prompt_index == prompt_index,
        )
    ).one()
    return row.id, row.output


def test_jobs_that_cannot_be_compared(world):
    settings, db, paths, high, _ = world
    other = repo.create_job(db, _spec("high").model_dump(mode="json"))
    repo.add_source(db, other, "/elsewhere/other.pdf")
    with pytest.raises(CompareError, match=r"share no source \(matched by uri\).*other.pdf"):
        compare_jobs(db, high, other)
    asks_else = repo.create_job(db, _spec("high", ["Something else entirely?"]).model_dump(mode="json"))
    repo.add_source(db, asks_else, str(paths[0]))
    with pytest.raises(CompareError, match="share no prompt"):
        compare_jobs(db, high, asks_else)
    not_split = repo.create_job(db, _spec("high").model_dump(mode="json"))
    repo.add_source(db, not_split, str(paths[0]))
    with pytest.raises(CompareError, match="share 1 source.*but no page or frame"):
        compare_jobs(db, high, not_split)
    with pytest.raises(CompareError, match="same job"):
        compare_jobs(db, high, high[:8])
    with pytest.raises(repo.JobNotFound):
        compare_jobs(db, high, "feedbeef00")
    result = run_cli(settings.home, "compare", high, other)
    assert result.returncode == 2 and "share no source" in result.stderr


def test_json_leaves_and_fields():
    value = {"a": {"b": [1, {"c": None}], "e": {}}, "f": True}
    assert dict(leaves(value)) == {"a.b[0]": 1, "a.b[1].c": None, "a.e": {}, "f": True}
    assert dict(leaves("x")) == {"$": "x"}
    same, fields = compare_json({"x": 1, "y": True, "z": [1]}, {"x": 1.0, "y": 1, "w": 2, "z": []})
    assert not same and fields == {"x": True, "y": False, "z[0]": False, "w": False, "z": False}
    assert terminal_safe("a\x1b[31mred\x07\nb", 80) == "a�[31mred� ⏎ b"


def test_compare_command(world, tmp_path):
    settings, db, _, high, low = world
    table = run_cli(settings.home, "compare", high[:10], low[:10])
    assert table.returncode == 0, table.stderr
    assert "agreement per prompt" in table.stdout and TEXT_PROMPTS[0] in table.stdout
    as_json = run_cli(settings.home, "compare", high, low, "--json", "--html", str(tmp_path / "report"))
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    expected = json.loads(json.dumps(compare_jobs(db, high, low).to_json(), default=str))
    assert data == expected
    assert data["job_a"]["visual_tokens_on_shared_units"] > data["job_b"]["visual_tokens_on_shared_units"]
    assert Counter(p["outcome"] for d in data["differing_pages"] for p in d["answers"]) == Counter(
        {"differ": sum(p["differ"] for p in data["prompts"])}
    )

    # The report in a real browser: every differing page with its image and both answers.
    index = tmp_path / "report" / "index.html"
    with chromium() as driver:
        driver.get(index.as_uri())
        cards = driver.find_elements("css selector", "section.diff")
        assert len(cards) == data["differing_units"] > 0
        answers = driver.find_elements("css selector", ".diff-answer")
        assert len(answers) == sum(len(d["answers"]) for d in data["differing_pages"])
        for answer in answers:
            assert answer.find_element("css selector", ".a pre").text.strip()
            assert answer.find_element("css selector", ".b pre").text.strip()
        images = load_all_images(driver)
        assert len(images) == len(cards) and all(i["width"] > 0 for i in images)
        rates = [e.text for e in driver.find_elements("css selector", ".agreement")]
        assert rates == [f"{p['agreement']:.1%}" for p in data["prompts"]]
        driver.save_screenshot(str(tmp_path / "compare.png"))
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_terminal_output_cannot_be_restyled_by_answers(world):
    """Model output with terminal escape codes or rich markup is printed as inert text."""
    settings, db, paths, high, low = world
    hostile = "[bold red]x[/] \x1b[2J\x1b]0;pwn\x07"
    with db.session() as session:
        rid = _result(session, low, str(paths[0]), 0, prompt_index=0)[0]
        original = session.scalar(select(RESULTS.c.text).where(RESULTS.c.id == rid))
        session.execute(update(RESULTS).where(RESULTS.c.id == rid).values(text=hostile))
    try:
        result = run_cli(settings.home, "compare", high, low, "--show", "50")
    finally:  # the other tests share these jobs
        with db.session() as session:
            session.execute(update(RESULTS).where(RESULTS.c.id == rid).values(text=original))
    assert result.returncode == 0, result.stderr
    assert "\x1b[2J" not in result.stdout and "\x07" not in result.stdout
    assert "[bold red]x[/]" in result.stdout


@pytest.mark.postgres
def test_compare_on_postgres(tmp_path, tiny_model_dir, postgres_url):
    """The same matching on PostgreSQL, where unit pairs stream from a server-side cursor while
    each chunk's answers are read on the same connection (chunks of 2 here)."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    paths = [write_pdf(inputs / "a.pdf", pages=2), write_video(inputs / "b.mp4", seconds=2)]
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir), database_url=postgres_url)
    # Greedy here: the sampled answers of the random model can hold NUL bytes, which PostgreSQL text
    # columns refuse (a pipeline issue, reported; not what this test is about).
    greedy = Sampling(max_new_tokens=8)
    high = make_job(settings, paths, _spec("high", sampling=greedy))
    low = make_job(settings, paths, _spec("low", sampling=greedy))
    db = Database(postgres_url)
    try:
        pairs = list(iter_unit_pairs(db, high, low, chunk_size=2))
        a, b = _answers(db, high), _answers(db, low)
        assert [(p.uri, p.unit_index) for p, _, _ in pairs] == sorted({(s, u) for s, u, _ in a})
        for pair, answers_a, answers_b in pairs:
            for i in range(len(TEXT_PROMPTS)):
                assert answers_a[i, 0, None].text == a[(pair.uri, pair.unit_index, i)]["text"]
                assert answers_b[i, 0, None].text == b[(pair.uri, pair.unit_index, i)]["text"]
        c = compare_jobs(db, high, low)
        for i, p in enumerate(c.prompts):
            same = sum(a[k]["text"].strip() == b[k]["text"].strip() for k in a if k[2] == i)
            assert (p.compared, p.agree) == (4, same)
        assert c.visual_tokens_shared == (
            sum(_unit_tokens(db, high).values()),
            sum(_unit_tokens(db, low).values()),
        )
    finally:
        db.dispose()
