"""HTML building blocks shared by the review site and the compare report.

Every value that comes from the database goes through ``esc`` (text and attribute values alike:
``html.escape`` with quotes): answers are untrusted model output, and so are source names. The
pages carry no script at all, and their Content-Security-Policy forbids any, so a slip in
escaping shows up as visible markup rather than running code. Links are relative, so the same
pages work served over HTTP and opened from disk.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from storage.review import ResultView, UnitView
from worker.results_export import question, span

# No script anywhere; images only from the site itself (or the export folder on disk).
CSP = (
    "default-src 'none'; script-src 'none'; img-src 'self' file:; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
JSON_MAX_DEPTH = 12

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 1.5em 2em;color:#1a1a1a;background:#fafafa}
h1{font-size:1.3em;margin:.8em 0 .3em}h2{font-size:1.1em;margin:1em 0 .4em}
a{color:#0645ad}table{border-collapse:collapse}td,th{padding:2px 8px;text-align:left;vertical-align:top}
table.grid td,table.grid th{border-bottom:1px solid #ddd}
.num{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#666}.err{color:#a00}.ok{color:#060}.warn{color:#a60}
.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:.85em;background:#e8e8e8}
.badge.failed{background:#f6d5d5}.badge.skipped{background:#f3ecd0}.badge.done{background:#d8efd8}
.badge.succeeded{background:#d8efd8}.badge.partial{background:#fbd9a5;color:#6b3d00}
.badge.running{background:#d6e6f8}
.tabs a,.tabs span{margin-right:1em}.tabs .current{font-weight:bold}
nav.pages{margin:.8em 0}nav.pages a,nav.pages span{margin-right:.8em}
.unit{display:flex;gap:1em;background:#fff;border:1px solid #ddd;border-radius:6px;padding:.8em;margin:.8em 0}
.unit .image{flex:0 0 auto;width:320px}
.unit .image img{max-width:320px;max-height:320px;border:1px solid #ccc}
.unit .body{flex:1 1 auto;min-width:0}.answer{border-top:1px solid #eee;padding:.4em 0}
.prompt{font-weight:600}.meta{font-size:.85em;color:#666}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f4f4;padding:.4em;margin:.3em 0}
table.json{border:1px solid #ddd;margin:.3em 0}table.json th{background:#f0f0f5;font-weight:600}
ol.json{margin:.2em 0;padding-left:1.6em}.j-s{color:#1a1a1a}.j-n{color:#05a}.j-k{color:#909}
.side{display:grid;grid-template-columns:1fr 1fr;gap:.6em}.side>div{min-width:0}
.window-span{font-size:.9em;color:#444}.strip{display:flex;flex-wrap:wrap;gap:.3em;margin:.2em 0}
.strip img{max-width:96px;max-height:96px;border:1px solid #ccc}
"""


def esc(value: Any) -> str:
    """Text for HTML content or a quoted attribute value."""
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">'
        '<meta name="referrer" content="no-referrer">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def pages_needed(total: int, per_page: int) -> int:
    return max(1, math.ceil(total / per_page))


def pager(current: int, total_pages: int, href: Any) -> str:
    """Previous / next and a window of page numbers; ``href(n)`` gives page n's link."""
    if total_pages <= 1:
        return ""
    parts = []
    if current > 1:
        parts.append(f'<a href="{esc(href(1))}">« first</a><a href="{esc(href(current - 1))}">‹ prev</a>')
    for n in range(max(1, current - 3), min(total_pages, current + 3) + 1):
        if n == current:
            parts.append(f'<span class="current">{n}</span>')
        else:
            parts.append(f'<a href="{esc(href(n))}">{n}</a>')
    if current < total_pages:
        parts.append(f'<a href="{esc(href(current + 1))}">next ›</a>')
        parts.append(f'<a href="{esc(href(total_pages))}">last »</a>')
    return f'<nav class="pages">page {current} of {total_pages}: {"".join(parts)}</nav>'


def fmt_int(n: int | None) -> str:
    return "" if n is None else f"{n:,}"


def fmt_when(when: datetime | None, missing: str = "") -> str:
    """A stored time as a person reads it, "2026-12-03 08:20 UTC" (the exact ISO time in the
    element's datetime attribute and its tooltip)."""
    if when is None:
        return esc(missing)
    when = when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)
    exact = when.isoformat(timespec="seconds")
    return f'<time datetime="{esc(exact)}" title="{esc(exact)}">{when:%Y-%m-%d %H:%M} UTC</time>'


def fmt_timestamp(seconds: float) -> str:
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{rest:06.3f}" if hours else f"{minutes}:{rest:06.3f}"


def unit_label(kind: str | None, index: int, timestamp: float | None) -> str:
    """Page numbers are 1-based (as a reader counts them); frames keep their stored index, the one
    that skip reasons and duplicate_of refer to, next to their timestamp."""
    if kind == "pdf":
        return f"page {index + 1}"
    if kind == "video" or timestamp is not None:
        at = f" at {fmt_timestamp(timestamp)}" if timestamp is not None else ""
        return f"frame {index}{at}"
    return "image" if index == 0 else f"image {index + 1}"


def render_json(value: Any, depth: int = 0) -> str:
    """A JSON value as nested tables and lists, every key and string escaped."""
    if depth >= JSON_MAX_DEPTH:
        return f"<pre>{esc(json.dumps(value, ensure_ascii=False))}</pre>"
    if isinstance(value, dict):
        if not value:
            return '<span class="j-k">{}</span>'
        rows = "".join(
            f"<tr><th>{esc(k)}</th><td>{render_json(v, depth + 1)}</td></tr>" for k, v in value.items()
        )
        return f'<table class="json">{rows}</table>'
    if isinstance(value, list):
        if not value:
            return '<span class="j-k">[]</span>'
        items = "".join(f"<li>{render_json(v, depth + 1)}</li>" for v in value)
        return f'<ol class="json" start="0">{items}</ol>'
    if isinstance(value, str):
        return f'<span class="j-s">{esc(value)}</span>'
    if value is None or isinstance(value, bool):
        return f'<span class="j-k">{esc(json.dumps(value))}</span>'
    return f'<span class="j-n">{esc(value)}</span>'


def render_answer_content(output: Any, text: str | None, error: str | None) -> str:
    """The answer itself: the JSON output readably (raw JSON folded below), else the text; then the error."""
    parts = []
    if output is not None:
        raw = json.dumps(output, ensure_ascii=False, indent=2)
        parts.append(
            f'<div class="json-view">{render_json(output)}</div>'
            f"<details><summary>raw JSON</summary><pre>{esc(raw)}</pre></details>"
        )
    elif text is not None:
        parts.append(f'<pre class="text">{esc(text)}</pre>')
    if error is not None:
        label = "schema error" if text is not None and output is None else "error"
        parts.append(f'<div class="err"><b>{label}:</b> {esc(error)}</div>')
    if not parts:
        parts.append('<div class="muted">(empty answer)</div>')
    return "".join(parts)


def _result_meta(r: ResultView) -> str:
    bits = [
        f"prompt {fmt_int(r.prompt_tokens)}",
        f"visual {fmt_int(r.visual_tokens - r.pruned_tokens)}"
        + (f" (+{fmt_int(r.pruned_tokens)} pruned)" if r.pruned_tokens else ""),
        f"completion {fmt_int(r.completion_tokens)} tokens",
    ]
    if r.finish_reason:
        bits.append(f"finish: {esc(r.finish_reason)}")
    bits.append(f"{r.latency_ms:,.0f} ms")
    if r.cache_hit:
        bits.append("visual tokens from cache")
    return " · ".join(bits)


def render_result(
    r: ResultView, prompts: list[str], kind: str | None = None, then: list[list[str]] | None = None
) -> str:
    state = "schema" if r.is_schema_error else ("error" if r.error is not None else "ok")
    prompt = question(prompts, then or [], r.prompt_index, r.turn) or "(prompt not in the spec)"
    number = f"Q{r.prompt_index + 1}" + (f", follow-up {r.turn}" if r.turn else "")
    if r.scope == "source":
        number = "Summary"
    # A window's strip once, above its first turn (its follow-ups come right after it).
    strip = _window_strip(r, kind) if r.scope == "window" and r.turn == 0 else ""
    return (
        f'<div class="answer" data-prompt="{r.prompt_index}" data-turn="{r.turn}" data-state="{state}">'
        f"{strip}"
        f'<div class="prompt">{number}: {esc(prompt)}</div>'
        f"{render_answer_content(r.output, r.text, r.error)}"
        f'<div class="meta">{_result_meta(r)}</div></div>'
    )


def _window_strip(r: ResultView, kind: str | None) -> str:
    """A window's answer (`--window`): what it covers, in words, over a strip of its pages or
    frames (thumbnails, each with its page or time); nothing for a page's own answer."""
    if not r.window:
        return ""
    (_, first, start), (_, last, end) = r.window[0], r.window[-1]
    covers = span(kind, first, last, start, end)
    thumbs = "".join(
        f'<a href="img/{unit_id}.png" class="full" title="{esc(unit_label(kind, index, at))}">'
        f'<img class="strip-thumb" src="thumb/{unit_id}.jpg" alt="{esc(unit_label(kind, index, at))}" '
        f'loading="lazy"></a>'
        for unit_id, index, at in r.window
    )
    return (
        f'<div class="window" data-from="{first}" data-to="{last}">'
        f'<div class="window-span">{esc(covers[:1].upper() + covers[1:])}</div>'
        f'<div class="strip">{thumbs}</div></div>'
    )


def image_cell(unit_id: int, label: str, has_image: bool) -> str:
    if not has_image:
        return '<div class="image muted">(no image)</div>'
    return (
        f'<div class="image"><a href="img/{unit_id}.png" class="full">'
        f'<img class="thumb" src="thumb/{unit_id}.jpg" alt="{esc(label)}" loading="lazy"></a></div>'
    )


def render_unit(
    unit: UnitView,
    kind: str | None,
    prompts: list[str],
    duplicate_href: str | None = None,
    then: list[list[str]] | None = None,
) -> str:
    label = unit_label(kind, unit.index, unit.timestamp)
    head = [f"<b>{esc(label)}</b>", f'<span class="badge {esc(unit.status)}">{esc(unit.status)}</span>']
    if unit.width and unit.height:
        head.append(f'<span class="muted">{unit.width}×{unit.height} px</span>')
    if unit.visual_tokens is not None:
        tokens = f"{fmt_int(unit.visual_tokens)} visual tokens"
        if unit.full_tokens and unit.full_tokens != unit.visual_tokens:
            tokens += f" ({fmt_int(unit.full_tokens)} at the model's own bounds)"
        head.append(f'<span class="muted">{tokens}</span>')
    if unit.cache_hit:
        head.append('<span class="muted">cache hit</span>')
    body = [f'<div class="unit-head">{" · ".join(head)}</div>']
    if unit.skip_reason is not None:
        link = ""
        if unit.duplicate_of is not None and duplicate_href is not None:
            link = f' <a class="duplicate" href="{esc(duplicate_href)}">→ frame {unit.duplicate_of}</a>'
        body.append(f'<div class="warn skip"><b>skipped:</b> {esc(unit.skip_reason)}{link}</div>')
    if unit.error is not None:
        body.append(f'<div class="err unit-error"><b>error:</b> {esc(unit.error)}</div>')
    # A source's summary is shown at the top of its page (site.source_page), not under a unit.
    own = [r for r in unit.results if r.scope != "source"]
    body.extend(render_result(r, prompts, kind, then) for r in own)
    # A done unit without answers of its own is in a window answered under the window's first unit.
    if not own and unit.status == "done":
        noun = "frame" if kind == "video" else "page"
        body.append(f'<div class="muted">answered in its window, under an earlier {noun}</div>')
    elif not own and unit.status not in ("skipped", "failed"):
        body.append('<div class="muted">no answer yet</div>')
    image = image_cell(unit.id, label, unit.image_key is not None)
    return (
        f'<section class="unit" id="u{unit.index}" data-unit="{unit.index}" data-status="{esc(unit.status)}">'
        f'{image}<div class="body">{"".join(body)}</div></section>'
    )


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "grid") -> str:
    """Cells are HTML already (callers escape); headers are escaped here."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
