"""The review site in a real browser (headless Chromium): served by `visbatch view JOB` and written
static by `visbatch view JOB --out DIR`, for a real job on the tiny model with PDF pages, an
image, video frames (two skipped as near-duplicates), a broken source, schema errors (every JSON
answer cut off at max_new_tokens) and two answers holding HTML (written into the results table,
as a model could have produced them).

What is expected is counted from the tables with plain SQL here, not through storage.review.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urldefrag

import pytest
from sqlalchemy import text as sql

from storage.db import Database
from tests.browser import chromium, load_all_images, require_browser, wait_for
from tests.review_jobs import (
    HOSTILE_OUTPUT,
    HOSTILE_TEXT,
    REVIEW_SPEC,
    make_job,
    overwrite_answer,
    write_review_inputs,
)
from visbatch.settings import Settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from worker.cli.main import app; app(prog_name='visbatch')"]


@dataclass
class SourceFacts:
    uri: str
    units: int
    with_image: int
    results: int
    schema_units: int
    first_width: int | None  # the first unit's image width (full size)
    skipped: dict[int, int]  # skipped unit index -> the index it duplicates


@dataclass
class ReviewJob:
    home: Path
    job_id: str
    sources: dict[str, SourceFacts]  # by file name
    broken_error: str


def _facts(db: Database, job_id: str) -> tuple[dict[str, SourceFacts], str]:
    sources: dict[str, SourceFacts] = {}
    broken_error = ""
    with db.session(readonly=True) as session:
        rows = session.execute(
            sql("SELECT id, uri, status, error FROM sources WHERE job_id = :j"), {"j": job_id}
        )
        for source_id, uri, status, error in rows.all():
            if status == "failed":
                broken_error = error
            units = session.execute(
                sql(
                    "SELECT unit_index, image_key, status, duplicate_of, width FROM units "
                    "WHERE source_id = :s ORDER BY unit_index"
                ),
                {"s": source_id},
            ).all()
            results = session.scalar(
                sql("SELECT count(*) FROM results r JOIN units u ON u.id = r.unit_id WHERE u.source_id = :s"),
                {"s": source_id},
            )
            schema_units = session.scalar(
                sql(
                    "SELECT count(DISTINCT u.id) FROM results r JOIN units u ON u.id = r.unit_id "
                    "WHERE u.source_id = :s AND r.error IS NOT NULL AND r.text IS NOT NULL"
                ),
                {"s": source_id},
            )
            sources[Path(uri).name] = SourceFacts(
                uri=uri,
                units=len(units),
                with_image=sum(1 for u in units if u.image_key is not None),
                results=int(results),
                schema_units=int(schema_units),
                first_width=units[0].width if units else None,
                skipped={u.unit_index: u.duplicate_of for u in units if u.status == "skipped"},
            )
    return sources, broken_error


@pytest.fixture(scope="module")
def review_job(tmp_path_factory, tiny_model_dir) -> ReviewJob:
    require_browser()  # before minutes of model work: skip (or fail under CI) right away
    root = tmp_path_factory.mktemp("review")
    inputs = write_review_inputs(root / "in")
    settings = Settings(home=root / "home", model=str(tiny_model_dir))
    job_id = make_job(settings, list(inputs.values()), REVIEW_SPEC)
    db = Database(settings.sqlalchemy_url())
    try:
        with db.session(readonly=True) as session:
            first_page, first_frame = (
                session.scalar(
                    sql(
                        "SELECT r.id FROM results r JOIN units u ON u.id = r.unit_id "
                        "JOIN sources s ON s.id = u.source_id "
                        "WHERE s.uri = :uri AND u.unit_index = 0 AND r.prompt_index = :p"
                    ),
                    {"uri": str(path), "p": prompt},
                )
                for path, prompt in ((inputs["pdf"], 0), (inputs["video"], 1))
            )
        overwrite_answer(db, first_page, text=HOSTILE_TEXT)
        overwrite_answer(db, first_frame, text=None, output=HOSTILE_OUTPUT)
        sources, broken_error = _facts(db, job_id)
    finally:
        db.dispose()
    # The job must hold every case the site has to show, or the checks below prove less than they say.
    assert sources["still.mp4"].skipped, "the still video gave no skipped frame"
    assert sources["invoice.pdf"].schema_units and sources["still.mp4"].schema_units
    assert broken_error and sources["broken.pdf"].units == 0
    return ReviewJob(root / "home", job_id, sources, broken_error)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VISBATCH_")}
    env.update(VISBATCH_HOME=str(home), PYTHONPATH=str(ROOT))
    return env


def _count(driver, selector: str) -> int:
    return len(driver.find_elements("css selector", selector))


def _text_content(driver, selector: str) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent);", selector
    )


def _walk_pages(driver, first_url: str) -> list[str]:
    """The URLs of a paginated listing, following 'next' links from ``first_url``."""
    urls = [first_url]
    driver.get(first_url)
    while True:
        nexts = [a for a in driver.find_elements("css selector", "nav.pages a") if a.text.startswith("next")]
        if not nexts:
            return urls
        urls.append(nexts[0].get_attribute("href"))
        driver.get(urls[-1])


def _check_no_script_ran(driver) -> None:
    assert driver.execute_script("return typeof window.__xss") == "undefined"
    assert driver.execute_script("return document.scripts.length") == 0


def _check_site(driver, index_url: str, job: ReviewJob, shots: Path, per_page: int) -> None:
    shots.mkdir(parents=True, exist_ok=True)
    driver.get(index_url)
    assert job.job_id in driver.find_element("css selector", "h1").text
    links = {
        Path(a.text).name: a.get_attribute("href") for a in driver.find_elements("css selector", "a.source")
    }
    assert set(links) == set(job.sources)
    assert job.broken_error.splitlines()[0] in " ".join(_text_content(driver, ".source-error"))
    # Words a person reads (issue 31, item 8): sources done (not `ingested`), the one whose answers
    # failed on an amber badge (not the grey of a badge without a colour), readable times.
    seen = driver.find_element("css selector", "body").text
    assert "ingested" not in seen and "null" not in seen and "cache_hits" not in seen
    states = dict(
        zip(_text_content(driver, "a.source"), _text_content(driver, ".sources .badge"), strict=True)
    )
    assert states[job.sources["broken.pdf"].uri] == "failed"
    assert states[job.sources["invoice.pdf"].uri] == "done, with failures"  # its schema errors
    badge = driver.find_element("css selector", ".sources .badge.partial")
    assert badge.value_of_css_property("background-color") not in (
        "rgba(232, 232, 232, 1)",
        "rgb(232, 232, 232)",
    )
    times = driver.find_elements("css selector", "time")
    assert times and all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", t.text) for t in times)
    driver.save_screenshot(str(shots / "index.png"))

    for name, facts in job.sources.items():
        pages = _walk_pages(driver, links[name])
        assert len(pages) == max(1, -(-facts.units // per_page)), name
        units = answers = images = 0
        for url in pages:
            driver.get(url)
            units += _count(driver, "section.unit")
            answers += _count(driver, ".answer")
            loaded = load_all_images(driver)
            assert all(image["width"] > 0 for image in loaded), (url, loaded)
            images += len(loaded)
            _check_no_script_ran(driver)
        assert (units, answers, images) == (facts.units, facts.results, facts.with_image), name

        driver.get(links[name])
        if facts.with_image:  # the thumbnail opens the full-size image
            full = driver.find_element("css selector", "a.full").get_attribute("href")
            driver.get(full)
            width = wait_for(
                lambda: driver.execute_script("return document.images[0].naturalWidth"), what="image"
            )
            assert width == facts.first_width
            driver.get(links[name])
        for view, expected in (("schema", facts.schema_units), ("skipped", len(facts.skipped))):
            tab = driver.find_element("css selector", f'.tabs [data-view="{view}"]')
            assert f"({expected})" in tab.text
            if expected == 0:
                continue
            tab.click()
            got = 0
            for url in _walk_pages(driver, driver.current_url):
                driver.get(url)
                got += _count(driver, "section.unit")
            assert got == expected, (name, view)

    # Frames skipped as near-duplicates link to the frame they repeat, on whichever page it is.
    video = job.sources["still.mp4"]
    driver.get(links["still.mp4"])
    driver.find_element("css selector", '.tabs [data-view="skipped"]').click()
    for index, duplicate_of in video.skipped.items():
        skipped_page = driver.current_url
        link = driver.find_element("css selector", f"#u{index} a.duplicate")
        link.click()
        assert urldefrag(driver.current_url).fragment == f"u{duplicate_of}"
        target = driver.find_element("css selector", f"#u{duplicate_of}")
        assert target.get_attribute("data-status") == "done"
        driver.get(skipped_page)

    # Answers holding HTML are shown as text, in text and JSON views alike, and nothing ran.
    driver.get(links["invoice.pdf"])
    assert HOSTILE_TEXT in _text_content(driver, "pre.text")
    assert _count(driver, "img") == min(per_page, job.sources["invoice.pdf"].with_image)
    _check_no_script_ran(driver)
    driver.get(links["still.mp4"])
    json_view = " ".join(_text_content(driver, ".json-view"))
    assert HOSTILE_OUTPUT["note"] in json_view
    assert '<b onmouseover="window.__xss=1">key</b>' in json_view
    raw = " ".join(_text_content(driver, "details pre"))
    assert "</td></tr></table><script>window.__xss=2</script>" in raw
    _check_no_script_ran(driver)
    driver.save_screenshot(str(shots / "video.png"))
    assert (shots / "video.png").stat().st_size > 10_000


def test_served_site_in_chromium(review_job, tmp_path):
    server = subprocess.Popen(
        [*CLI, "view", review_job.job_id[:8], "--port", "0"],
        env=_env(review_job.home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("serving job"), line + server.stderr.read()
        url = line.split(" at ", 1)[1].split()[0]
        with chromium() as driver:
            _check_site(driver, url, review_job, tmp_path / "served", per_page=50)
            driver.get(url + "no-such-page.html")
            assert "404" in driver.find_element("css selector", "h1").text
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_static_site_in_chromium(review_job, tmp_path):
    out = tmp_path / "site"
    result = subprocess.run(
        [*CLI, "view", review_job.job_id, "--out", str(out), "--per-page", "2"],
        env=_env(review_job.home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # Self-contained: every image is a file in the folder, every link relative.
    assert len(list((out / "img").iterdir())) == sum(s.with_image for s in review_job.sources.values())
    html = "".join(p.read_text() for p in out.glob("*.html"))
    assert "http://" not in html and "https://" not in html and 'src="/' not in html
    with chromium() as driver:
        _check_site(driver, (out / "index.html").as_uri(), review_job, tmp_path / "static", per_page=2)
