"""The review site of one job: every page it has, by relative path, rendered from the database.

One layout for both ways of showing it: the HTTP server (``server.py``) renders a path when it is
asked for, the static export (``export.py``) walks every path once and writes it to disk. Paths:

    index.html, index-N.html                 the job and its sources with their counts
    source-SID-VIEW-N.html                   page N of one source's units under a filter
                                             (VIEW: all, failed, schema, skipped)
    img/UNIT.png, thumb/UNIT.jpg             a unit's image, full size and thumbnail
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from storage.db import Database
from storage.object_store import ObjectNotFound, ObjectStore
from storage.review import (
    VIEWS,
    JobInfo,
    SourceSummary,
    count_sources,
    count_units,
    get_source,
    job_spec,
    load_job,
    source_page,
    unit_image_key,
    unit_page,
    unit_position,
)
from worker.review.html import esc, fmt_int, page, pager, pages_needed, render_json, render_unit, table
from worker.review.images import Thumbnails

UNITS_PER_PAGE = 50
SOURCES_PER_PAGE = 200

VIEW_TITLES = {
    "all": "all",
    "failed": "failed answers",
    "schema": "schema errors",
    "skipped": "skipped frames",
}

_INDEX = re.compile(r"index(?:-(\d+))?\.html")
_SOURCE = re.compile(rf"source-(\d+)-({'|'.join(VIEWS)})-(\d+)\.html")
_IMAGE = re.compile(r"(img|thumb)/(\d+)\.(png|jpg)")


def index_href(n: int) -> str:
    return "index.html" if n == 1 else f"index-{n}.html"


def source_href(source_id: int, view: str = "all", n: int = 1) -> str:
    return f"source-{source_id}-{view}-{n}.html"


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str
    # HTML reflects a job that may still run; images of a unit never change.
    immutable: bool = False


def _html(text: str) -> Response:
    return Response(text.encode(), "text/html; charset=utf-8")


class ReviewSite:
    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        job_id: str,
        *,
        thumbnails: Thumbnails | None = None,
        per_page: int = UNITS_PER_PAGE,
        sources_per_page: int = SOURCES_PER_PAGE,
    ) -> None:
        if per_page < 1 or sources_per_page < 1:
            raise ValueError("pages must hold at least one item")
        self.db = db
        self.store = store
        # Resolves a prefix (JobNotFound if none); a job's prompts never change.
        self.job_id, spec = job_spec(db, job_id)
        self.prompts: list[str] = list(spec.get("prompts") or [])
        self.thumbnails = thumbnails
        self.per_page = per_page
        self.sources_per_page = sources_per_page

    # -- routing -------------------------------------------------------------------------------

    def get(self, path: str) -> Response | None:
        """The page or image at a relative path, or None (no such page: 404)."""
        path = path.lstrip("/") or "index.html"
        if m := _INDEX.fullmatch(path):
            text = self.index_page(int(m.group(1) or 1))
            return None if text is None else _html(text)
        if m := _SOURCE.fullmatch(path):
            text = self.source_page(int(m.group(1)), m.group(2), int(m.group(3)))
            return None if text is None else _html(text)
        if m := _IMAGE.fullmatch(path):
            kind, unit_id, ext = m.groups()
            if (kind, ext) == ("img", "png"):
                return self.image(int(unit_id))
            if (kind, ext) == ("thumb", "jpg"):
                return self.thumbnail(int(unit_id))
        return None

    def image(self, unit_id: int) -> Response | None:
        key = unit_image_key(self.db, self.job_id, unit_id)
        if key is None:
            return None
        try:
            return Response(self.store.get_bytes(key), "image/png", immutable=True)
        except ObjectNotFound:
            return None

    def thumbnail(self, unit_id: int) -> Response | None:
        key = unit_image_key(self.db, self.job_id, unit_id)
        if key is None or self.thumbnails is None:
            return None
        try:
            return Response(self.thumbnails.get(key), "image/jpeg", immutable=True)
        except ObjectNotFound:
            return None

    # -- pages ---------------------------------------------------------------------------------

    def index_pages(self) -> int:
        return pages_needed(count_sources(self.db, self.job_id), self.sources_per_page)

    def source_pages(self, source: SourceSummary, view: str) -> int:
        return pages_needed(source.view_counts.get(view, 0), self.per_page)

    def index_page(self, n: int) -> str | None:
        job = load_job(self.db, self.job_id)
        total_pages = self.index_pages()
        if not 1 <= n <= total_pages:
            return None
        size = self.sources_per_page
        sources = source_page(self.db, self.job_id, offset=(n - 1) * size, limit=size)
        rows = [_source_row(s) for s in sources]
        headers = ["source", "kind", "status", "units", "done", "units with failures", "skipped frames",
                   "answers", "failed answers", "units with schema errors", "visual tokens",
                   "completion tokens"]  # fmt: skip
        body = [
            _job_header(job),
            f"<h2>Sources ({fmt_int(job.sources_total)})</h2>",
            pager(n, total_pages, index_href),
            table(headers, rows, cls="grid sources"),
            pager(n, total_pages, index_href),
        ]
        return page(f"visbatch job {job.id}", "\n".join(body))

    def source_page(self, source_id: int, view: str, n: int) -> str | None:
        source = get_source(self.db, self.job_id, source_id)
        if source is None:
            return None
        total = count_units(self.db, self.job_id, source_id, view)
        total_pages = pages_needed(total, self.per_page)
        if not 1 <= n <= total_pages:
            return None
        size = self.per_page
        units = unit_page(self.db, self.job_id, source_id, view, offset=(n - 1) * size, limit=size)
        cards = []
        for unit in units:
            duplicate_href = None
            if unit.duplicate_of is not None:
                position = unit_position(self.db, source_id, unit.duplicate_of)
                target = source_href(source_id, "all", position // size + 1)
                duplicate_href = f"{target}#u{unit.duplicate_of}"
            cards.append(render_unit(unit, source.kind, self.prompts, duplicate_href))
        tabs = []
        for name in VIEWS:
            label = f"{VIEW_TITLES[name]} ({fmt_int(source.view_counts.get(name, 0))})"
            if name == view:
                tabs.append(f'<span class="current" data-view="{name}">{esc(label)}</span>')
            else:
                href = esc(source_href(source_id, name))
                tabs.append(f'<a href="{href}" data-view="{name}">{esc(label)}</a>')
        nav = pager(n, total_pages, lambda k: source_href(source_id, view, k))
        head = [
            f'<p><a href="index.html">← job {esc(self.job_id)}</a></p>',
            f"<h1>{esc(source.uri)}</h1>",
            f'<p>{esc(source.kind or "unknown kind")} · <span class="badge {esc(source.status)}">'
            f"{esc(source.status)}</span> · {fmt_int(source.units)} units · "
            f"{fmt_int(source.visual_tokens)} visual tokens · "
            f"{fmt_int(source.completion_tokens)} completion tokens</p>",
        ]
        if source.error:
            head.append(f'<p class="err source-error"><b>error:</b> {esc(source.error)}</p>')
        head.append(f'<p class="tabs">{"".join(tabs)}</p>')
        if not units:
            empty = "no pages or frames" if view == "all" else "nothing here under this filter"
            cards.append(f'<p class="muted">{empty}</p>')
        body = "\n".join([*head, nav, *cards, nav])
        return page(f"{source.uri} ({VIEW_TITLES[view]}, page {n})", body)


def _source_row(s: SourceSummary) -> list[str]:
    def count_link(view: str, n: int) -> str:
        if n == 0:
            return '<span class="muted">0</span>'
        return f'<a href="{esc(source_href(s.id, view))}" data-view="{view}">{fmt_int(n)}</a>'

    name = f'<a class="source" href="{esc(source_href(s.id))}" title="{esc(s.uri)}">{esc(s.uri)}</a>'
    if s.error:
        name += f'<div class="err source-error">{esc(s.error)}</div>'
    return [
        name,
        esc(s.kind or ""),
        f'<span class="badge {esc(s.status)}">{esc(s.status)}</span>',
        f'<span class="num">{fmt_int(s.units)}</span>',
        f'<span class="num">{fmt_int(s.done)}</span>',
        count_link("failed", s.view_counts.get("failed", 0)),
        count_link("skipped", s.view_counts.get("skipped", 0)),
        f'<span class="num">{fmt_int(s.answers)}</span>',
        f'<span class="num">{fmt_int(s.answers_failed)}</span>',
        count_link("schema", s.view_counts.get("schema", 0)),
        f'<span class="num">{fmt_int(s.visual_tokens)}</span>',
        f'<span class="num">{fmt_int(s.completion_tokens)}</span>',
    ]


def _job_header(job: JobInfo) -> str:
    spent = job.tokens.get("spent", {})
    saved = job.tokens.get("saved", {})
    spec = job.spec
    facts = [
        ("status", f'<span class="badge {esc(job.status)}">{esc(job.status)}</span>'),
        ("model", esc(spec.get("model") or "")),
        ("created", esc(job.created_at.isoformat(timespec="seconds") if job.created_at else "")),
        ("finished", esc(job.finished_at.isoformat(timespec="seconds") if job.finished_at else "not yet")),
        ("sources", f"{fmt_int(job.sources_total)} ({fmt_int(job.sources_failed)} failed)"),
        (
            "units",
            f"{fmt_int(job.units_total)} ({fmt_int(job.units_failed)} failed, "
            f"{fmt_int(job.tokens.get('units_skipped', 0))} skipped)",
        ),  # fmt: skip
        (
            "tokens spent",
            f"visual {fmt_int(spent.get('visual'))} · prompt {fmt_int(spent.get('prompt'))} · "
            f"completion {fmt_int(spent.get('completion'))}",
        ),  # fmt: skip
        ("visual tokens saved", " · ".join(f"{esc(k)} {fmt_int(v)}" for k, v in saved.items())),
    ]
    if job.error:
        facts.append(("error", f'<span class="err">{esc(job.error)}</span>'))
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in facts)
    prompts = "".join(f"<li>{esc(p)}</li>" for p in job.prompts)
    schema = ""
    if spec.get("json_schema") is not None:
        schema = f"<details><summary>JSON schema</summary>{render_json(spec['json_schema'])}</details>"
    budget = spec.get("budget")
    budget_html = ""
    if budget:
        budget_html = f"<details><summary>visual-token budget</summary>{render_json(budget)}</details>"
    return (
        f"<h1>visbatch job {esc(job.id)}</h1><table>{rows}</table>"
        f'<h2>Prompts</h2><ol class="prompts">{prompts}</ol>{schema}{budget_html}'
    )
