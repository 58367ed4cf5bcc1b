"""The review site without a browser: its HTML escapes every stored value, and the data path works
from SQLite with a folder store and from PostgreSQL with an S3 store (moto), served over real
HTTP and exported static. The commands never import torch or transformers."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser
from io import BytesIO

import pytest
from PIL import Image
from sqlalchemy import text as sql

from storage.db import Database
from storage.object_store import open_object_store
from storage.review import ResultView, UnitView, unit_image_key
from tests.review_jobs import (
    HOSTILE_OUTPUT,
    HOSTILE_TEXT,
    REVIEW_SPEC,
    make_job,
    run_cli,
    write_review_inputs,
)
from visbatch.settings import Settings
from worker.review.export import export_site
from worker.review.html import render_json, render_unit
from worker.review.images import Thumbnails
from worker.review.server import make_server
from worker.review.site import ReviewSite

SAFE_TAGS = {"section", "div", "span", "b", "a", "img", "pre", "details", "summary"} | {
    "table", "tr", "th", "td", "ol", "li"}  # fmt: skip


class _Tags(HTMLParser):
    """Every element and attribute the browser would build from a fragment."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _parse(fragment: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(fragment)
    return parser.tags


def _hostile_unit() -> UnitView:
    result = dict(prompt_tokens=1, visual_tokens=2, completion_tokens=3, pruned_tokens=0, cache_hit=False,
                  latency_ms=1.0)  # fmt: skip
    return UnitView(
        id=7,
        index=3,
        timestamp=1.5,
        width=10,
        height=10,
        image_key="images/ab/x.png",
        status='done"><script>bad()</script>',
        error="<script>bad()</script>",
        visual_tokens=4,
        full_tokens=4,
        cache_hit=False,
        skip_reason='<img src=x onerror="bad()">',
        duplicate_of=1,
        results=[
            ResultView(
                prompt_index=0, output=None, text=HOSTILE_TEXT, error=None, finish_reason="stop", **result
            ),
            ResultView(
                prompt_index=1, output=HOSTILE_OUTPUT, text="{}", error=None, finish_reason="<i>", **result
            ),
            ResultView(
                prompt_index=0,
                output=None,
                text="{",
                error='"><svg onload=bad()>',
                finish_reason=None,
                **result,
            ),  # fmt: skip
        ],
    )


def test_every_stored_value_is_escaped():
    prompts = ['Say "<script>bad()</script>"', "<svg onload=bad()>"]
    fragment = render_unit(_hostile_unit(), "video", prompts, duplicate_href="source-1-all-1.html#u1")
    tags = _parse(fragment)
    assert {tag for tag, _ in tags} <= SAFE_TAGS
    assert not [(tag, name) for tag, attrs in tags for name in attrs if name.startswith("on")]
    assert [attrs["src"] for tag, attrs in tags if tag == "img"] == ["thumb/7.jpg"]
    # The literal text survives, escaped, in content and in attribute values alike.
    assert "&lt;script&gt;window.__xss = &quot;text&quot;&lt;/script&gt;" in fragment
    assert 'data-status="done&quot;&gt;&lt;script&gt;bad()&lt;/script&gt;"' in fragment
    json_tags = _parse(render_json({"<b>k</b>": ['"</td><script>x()</script>', 1, None, True]}))
    assert {tag for tag, _ in json_tags} == {"table", "tr", "th", "td", "ol", "li", "span"}


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _expected(db: Database, job_id: str) -> dict[int, tuple[int, int, list[int]]]:
    """Per source id: units, results, unit ids with an image (plain SQL, not storage.review)."""
    out = {}
    with db.session(readonly=True) as session:
        for (source_id,) in session.execute(sql("SELECT id FROM sources WHERE job_id = :j"), {"j": job_id}):
            units = session.execute(
                sql("SELECT id, image_key FROM units WHERE source_id = :s"), {"s": source_id}
            ).all()
            results = session.scalar(
                sql("SELECT count(*) FROM results r JOIN units u ON u.id = r.unit_id WHERE u.source_id = :s"),
                {"s": source_id},
            )
            out[source_id] = (len(units), int(results), [u.id for u in units if u.image_key is not None])
    return out


@pytest.fixture(params=["sqlite-folder", pytest.param("postgres-s3", marks=pytest.mark.postgres)])
def stored_job(request, tmp_path, tiny_model_dir):
    overrides: dict[str, str] = {}
    if request.param == "postgres-s3":
        s3_server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        overrides = dict(
            database_url=request.getfixturevalue("postgres_url"),
            store_url=f"s3://{bucket}/store",
            s3_endpoint_url=s3_server,
        )
    settings = Settings(home=tmp_path / "home", model=str(tiny_model_dir), **overrides)
    inputs = write_review_inputs(tmp_path / "in")
    job_id = make_job(settings, list(inputs.values()), REVIEW_SPEC)
    db = Database(settings.sqlalchemy_url())
    store = open_object_store(settings.object_store_url(), endpoint_url=settings.s3_endpoint_url)
    yield settings, db, store, job_id
    db.dispose()


@pytest.mark.slow
def test_served_and_static_site_from_each_backend(stored_job, tmp_path):
    settings, db, store, job_id = stored_job
    expected = _expected(db, job_id)
    all_images = [unit_id for *_, ids in expected.values() for unit_id in ids]
    site = ReviewSite(db, store, job_id, thumbnails=Thumbnails(store, tmp_path / "thumbs"), per_page=3)
    server = make_server(site, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        status, headers, body = _get(base)
        assert status == 200 and "script-src 'none'" in headers["Content-Security-Policy"]
        assert body.decode().count('class="source"') == len(expected)
        for source_id, (units, results, with_image) in expected.items():
            shown_units = shown_answers = 0
            for n in range(1, max(1, -(-units // 3)) + 1):
                status, _, page = _get(f"{base}source-{source_id}-all-{n}.html")
                assert status == 200
                shown_units += page.decode().count('<section class="unit"')
                shown_answers += page.decode().count('<div class="answer"')
            assert (shown_units, shown_answers) == (units, results)
            assert _get(f"{base}source-{source_id}-all-{max(1, -(-units // 3)) + 1}.html")[0] == 404
            for unit_id in with_image:
                status, headers, png = _get(f"{base}img/{unit_id}.png")
                assert status == 200 and headers["Content-Type"] == "image/png"
                full = Image.open(BytesIO(png))
                status, headers, jpeg = _get(f"{base}thumb/{unit_id}.jpg")
                assert status == 200 and headers["Content-Type"] == "image/jpeg"
                thumb = Image.open(BytesIO(jpeg))
                assert max(thumb.size) <= 320 and thumb.size[0] <= full.size[0]
        # Thumbnails are cached on disk, one per distinct image.
        with db.session(readonly=True) as session:
            keys = session.scalar(
                sql(
                    "SELECT count(DISTINCT image_key) FROM units WHERE job_id = :j AND image_key IS NOT NULL"
                ),
                {"j": job_id},
            )
        assert len(list((tmp_path / "thumbs").rglob("*.jpg"))) == keys
        # Only this job's images, and nothing outside the site's paths.
        assert unit_image_key(db, "0" * 32, all_images[0]) is None
        for path in ("img/999999.png", "thumb/999999.jpg", "../visbatch.db", "img/1.jpg", "index-9.html"):
            assert _get(base + path)[0] == 404, path
    finally:
        server.shutdown()
        server.server_close()

    report = export_site(site, tmp_path / "site")
    images = len(all_images)
    assert report.images == images and not report.missing_images
    assert len(list((tmp_path / "site" / "img").glob("*.png"))) == images
    for path in (tmp_path / "site" / "thumb").glob("*.jpg"):
        assert max(Image.open(path).size) <= 320

    # An image gone from the store: a 404 for it, and the export goes on and names it.
    unit_id = all_images[0]
    key = unit_image_key(db, job_id, unit_id)
    store.delete(key)
    site.thumbnails = Thumbnails(store, tmp_path / "thumbs-2")
    assert site.get(f"img/{unit_id}.png") is None and site.get(f"thumb/{unit_id}.jpg") is None
    report = export_site(site, tmp_path / "site-2")
    assert set(report.missing_images) == {key} and report.images == images - len(report.missing_images)


@pytest.mark.slow
@pytest.mark.parametrize("stored_job", ["sqlite-folder"], indirect=True)
def test_view_command_is_light_and_clear(stored_job, tmp_path):
    settings, db, store, job_id = stored_job
    home = settings.home
    result = run_cli(home, "view", job_id, "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "index.html").is_file()
    # stderr says what its lines are: no bare path (issue 31, item 8).
    head, *lines = result.stderr.splitlines()
    assert head == f"writing the review pages of job {job_id} to {tmp_path / 'out'}:", result.stderr
    assert lines and all(line.startswith("  wrote the pages of /") for line in lines), result.stderr
    missing = run_cli(home, "view", "feedbeef00")
    assert missing.returncode == 2 and "no job 'feedbeef00'" in missing.stderr
    empty = run_cli(tmp_path / "empty-home", "view", "feedbeef00")
    # No database there: exit 4 like every command that reads, naming the file (none is made).
    assert empty.returncode == 4 and f"no visbatch database at {tmp_path / 'empty-home'}" in empty.stderr
    assert "visbatch db upgrade" in empty.stderr and not (tmp_path / "empty-home").exists()


class _Text(HTMLParser):
    """What a reader sees: the text between the tags (attribute values left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hidden += tag in ("style", "title")

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in ("style", "title")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def _seen(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return " ".join(" ".join(parser.parts).split())


def test_the_pages_say_things_in_words(sqlite_db, tmp_path):
    """Issue 31, item 8: a finished source is `done` (not its pipeline step `ingested`), the budget
    and the savings in words (no `null`, no `skipped_frames`), pages+frames (not `units`), times a
    person reads, and the `partial` badge in a warning colour."""
    from ingest.spec import JobSpec
    from storage import repository as repo
    from storage.repository import ResultRow, UnitRow
    from worker.review.html import STYLE

    db = sqlite_db
    spec = JobSpec(prompts=["Total?"]).model_dump(mode="json")
    started = repo.start_job(db, spec, [("/in/a.pdf", None), ("/in/b.pdf", None)])
    done = []
    for n, (source_id, _uri) in enumerate(started.sources):
        rows = [UnitRow(i, 64, 64, f"images/{n}-{i}.png", 100) for i in range(3)]
        unit_ids = repo.add_units(db, started.job_id, source_id, rows)
        repo.complete_source(db, source_id, kind="pdf", sha256="a" * 64, size=10)
        repo.mark_units_encoded(db, [(u, f"key{n}", i > 0) for i, u in enumerate(unit_ids)])
        pairs = [
            (started.job_id, ResultRow(u, 0, None, "42", "bad" if (n, i) == (1, 0) else None, 10, 100, 2,
                                       "stop", "m", "e", False, 1.0))
            for i, u in enumerate(unit_ids)
        ]  # fmt: skip
        done.append(repo.store_results(db, pairs, [(started.job_id, u) for u in unit_ids]))
    assert repo.close_job(db, started.job_id) == "partial"

    site = ReviewSite(db, open_object_store((tmp_path / "store").as_uri()), started.job_id)
    index = site.index_page(1)
    seen = _seen(index)
    assert "ingested" not in seen and "null" not in seen
    assert "skipped_frames" not in seen and "cache_hits" not in seen and "units" not in seen
    assert "pages+frames 6 (0 failed, 0 skipped)" in seen
    assert "from the cache 400" in seen  # 4 pages served by the cache, in words
    assert "detail preset not set" in seen and "pruning keep all (no pruning)" in seen
    a, b = (f'href="source-{source_id}-all-1.html"' for source_id, _ in started.sources)
    row_a, row_b = (index.split(href, 1)[1].split("</tr>", 1)[0] for href in (a, b))
    assert '<span class="badge done" data-state="ingested">done</span>' in row_a
    assert '<span class="badge partial" data-state="ingested">done, with failures</span>' in row_b
    assert '<span class="badge partial">partial</span>' in index
    assert ".badge.partial{background:#fbd9a5" in STYLE  # amber, not the default grey
    # Times: "2026-12-03 08:20 UTC" to read, the exact ISO time in the attribute only.
    assert re.search(r"created \d{4}-\d\d-\d\d \d\d:\d\d UTC finished \d{4}-\d\d-\d\d \d\d:\d\d UTC", seen)
    assert not re.search(r"\d\dT\d\d:\d\d", seen)
    source = _seen(site.source_page(started.sources[0][0], "all", 1))
    assert "3 pages" in source and "units" not in source and "ingested" not in source
