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
from typing import Any

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
from worker.results_export import asked
from worker.review.html import (
    esc,
    fmt_int,
    fmt_when,
    page,
    pager,
    pages_needed,
    render_json,
    render_result,
    render_unit,
    table,
)
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
        self.prompts: list[str] = asked(spec)  # a source's summary's too (`--summarize`)
        self.then: list[list[str]] = list(spec.get("then") or [])
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
        headers = ["source", "kind", "status", "pages+frames", "answered", "with failures", "skipped frames",
                   "answers", "failed answers", "with schema errors", "visual tokens",
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
            cards.append(render_unit(unit, source.kind, self.prompts, duplicate_href, self.then))
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
            f"<p>{esc(source.kind or 'unknown kind')} · {_state_badge(source)} · "
            f"{fmt_int(source.units)} {_unit_noun(source.kind, source.units)} · "
            f"{fmt_int(source.visual_tokens)} visual tokens · "
            f"{fmt_int(source.completion_tokens)} completion tokens</p>",
        ]
        if source.error:
            head.append(f'<p class="err source-error"><b>error:</b> {esc(source.error)}</p>')
        summaries = [r for unit in units for r in unit.results if r.scope == "source"]
        if summaries:  # `--summarize`: the source's summary first
            answers = "".join(render_result(r, self.prompts, source.kind, self.then) for r in summaries)
            head.append(f'<section class="summary">{answers}</section>')
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
        _state_badge(s),
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


# A source's state as a person says it, with its badge's colour: the stored status is a pipeline
# step (`ingested` is split into pages, not answered).
_STATE_BADGES = {"done": "done", "done, with failures": "partial", "failed": "failed"}


def source_state(s: SourceSummary) -> str:
    """done, done with failures, unfinished (pages not answered yet), partly split, not split yet
    or failed."""
    if s.status == "failed":
        return "failed"
    if s.status == "pending":
        return "partly split" if s.units else "not split yet"
    if s.units - s.done - s.failed - s.skipped > 0:
        return "unfinished"
    return "done, with failures" if s.failed or s.answers_failed else "done"


def _state_badge(s: SourceSummary) -> str:
    state = source_state(s)
    cls = _STATE_BADGES.get(state, "")
    return f'<span class="badge {cls}" data-state="{esc(s.status)}">{esc(state)}</span>'


def _unit_noun(kind: str | None, n: int) -> str:
    """What a source's units are: pages of a PDF, frames of a video, an image."""
    noun = {"pdf": "page", "video": "frame", "image": "image"}.get(kind or "", "page or frame")
    if n == 1:
        return noun
    return "pages or frames" if noun == "page or frame" else f"{noun}s"


# What each saving is (storage.token_report), in words.
_SAVED = {
    "detail": "by the detail settings",
    "skipped_frames": "by skipped frames",
    "cache_hits": "from the cache",
    "pruning": "by pruning",
    "merging": "by merging",
}


def _saved(saved: dict[str, int]) -> str:
    parts = [f"{_SAVED.get(key, key.replace('_', ' '))} {fmt_int(n)}" for key, n in saved.items() if n]
    return esc(" · ".join(parts)) if parts else '<span class="muted">none</span>'


def _spent(job: JobInfo) -> str:
    spent = job.tokens.get("spent", {})
    text = (
        f"visual {fmt_int(spent.get('visual'))} (pages+frames encoded) · "
        f"prompt {fmt_int(spent.get('prompt'))} · completion {fmt_int(spent.get('completion'))}"
    )
    later = job.tokens.get("units_not_encoded")
    if later:  # a stopped job: split, not through the tower yet (storage.token_report)
        planned = fmt_int(job.tokens.get("visual_not_encoded"))
        text += f"; {planned} more planned for {fmt_int(later)} not encoded yet"
    return esc(text)


def _budget_value(key: str, value: Any) -> str:
    if key == "detail":
        return "not set" if value is None else str(value)
    if key in ("min_pixels", "max_pixels"):
        return "the model's own" if value is None else f"{value:,} pixels"
    if key.startswith("max_tokens_per_"):
        return "no cap" if value is None else f"{value:,} tokens"
    if key == "skip_redundant_frames":
        return "yes" if value else "no"
    if key in ("prune_keep", "merge_keep"):
        if value is None or value >= 1:
            return f"keep all (no {'pruning' if key == 'prune_keep' else 'merging'})"
        return f"keep {value:.0%}"
    if key == "redundancy_threshold":
        return f"a mean RGB difference under {value:g} (of 255)"
    if key == "drop_static":
        return "keep all (off)" if not value else f"changed by under {value:g} (relative)"
    return "not set" if value is None else str(value)


_BUDGET_LABELS = {
    "detail": "detail preset",
    "min_pixels": "fewest pixels per image",
    "max_pixels": "most pixels per image",
    "max_tokens_per_frame": "tokens per page or frame",
    "max_tokens_per_video": "tokens per video",
    "skip_redundant_frames": "skip repeated video frames",
    "redundancy_threshold": "a frame repeats the last kept one at",
    "prune_keep": "pruning",
    "merge_keep": "merging",
    "drop_static": "a window's static patches left out when",
}


def _budget(budget: dict[str, Any]) -> str:
    """The job's visual-token budget in words (a setting left unset is the model's own)."""
    rows = "".join(
        f"<tr><th>{esc(_BUDGET_LABELS.get(key, key.replace('_', ' ')))}</th>"
        f"<td>{esc(_budget_value(key, value))}</td></tr>"
        for key, value in budget.items()
    )
    return f'<table class="budget">{rows}</table>'


def _job_header(job: JobInfo) -> str:
    saved = job.tokens.get("saved", {})
    spec = job.spec
    facts = [
        ("status", f'<span class="badge {esc(job.status)}">{esc(job.status)}</span>'),
        ("model", esc(spec.get("model") or "")),
        ("created", fmt_when(job.created_at)),
        ("finished", fmt_when(job.finished_at, "not yet")),
        ("sources", f"{fmt_int(job.sources_total)} ({fmt_int(job.sources_failed)} failed)"),
        (
            "pages+frames",
            f"{fmt_int(job.units_total)} ({fmt_int(job.units_failed)} failed, "
            f"{fmt_int(job.tokens.get('units_skipped', 0))} skipped)",
        ),  # fmt: skip
        ("tokens spent", _spent(job)),
        ("visual tokens saved", _saved(saved)),
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
        budget_html = f"<details><summary>visual-token budget</summary>{_budget(budget)}</details>"
    return (
        f"<h1>visbatch job {esc(job.id)}</h1><table>{rows}</table>"
        f'<h2>Prompts</h2><ol class="prompts">{prompts}</ol>{schema}{budget_html}'
    )
