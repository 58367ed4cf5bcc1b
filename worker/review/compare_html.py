"""`visbatch compare --html DIR`: the comparison as a static site, differing pages side by side.

``index.html`` holds the figures (agreement per prompt and per JSON field, tokens spent) and the
first page of differing pages; ``diff-N.html`` the next ones. Each differing page shows its image
(both runs' when they differ, e.g. another render size) beside the two answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from storage.object_store import ObjectNotFound, ObjectStore
from worker.review.compare import Comparison, DiffAnswer, DiffPage, PromptAgreement
from worker.review.html import (
    esc,
    fmt_int,
    image_cell,
    page,
    pager,
    pages_needed,
    render_answer_content,
    render_json,
    table,
    unit_label,
)
from worker.review.images import copy_image

log = logging.getLogger(__name__)

DIFFS_PER_PAGE = 50
OUTCOME_TITLES = {
    "differ": "answers differ",
    "failed_a": "failed in A only",
    "failed_b": "failed in B only",
    "missing_a": "no answer in A",
    "missing_b": "no answer in B",
}


def diff_href(n: int) -> str:
    return "index.html" if n == 1 else f"diff-{n}.html"


def _rate(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.1%}"


def _summary(c: Comparison) -> str:
    a, b = c.job_a, c.job_b
    jobs = []
    for name, info, shared in (("A", a, c.visual_tokens_shared[0]), ("B", b, c.visual_tokens_shared[1])):
        spent = info.tokens.get("spent", {})
        budget = info.spec.get("budget") or {}
        jobs.append([
            f"<b>{name}</b>",
            f'<span class="job-id">{esc(info.id)}</span>',
            esc(info.status),
            esc(info.spec.get("model") or ""),
            render_json({k: v for k, v in budget.items() if v not in (None, False)} or "model defaults"),
            f'<span class="num visual-spent">{fmt_int(spent.get("visual"))}</span>',
            f'<span class="num visual-shared">{fmt_int(shared)}</span>',
            f'<span class="num">{fmt_int(spent.get("completion"))}</span>',
        ])  # fmt: skip
    jobs_table = table(
        ["", "job", "status", "model", "budget", "visual tokens (job)", "visual tokens (shared units)",
         "completion tokens"], jobs, cls="grid jobs")  # fmt: skip
    prompt_rows = [_prompt_row(p) for p in c.prompts]
    prompts_table = table(
        ["prompt", "kind", "units", "compared", "agree", "agreement", "differ", "failed in A", "failed in B",
         "failed in both", "no answer in A", "no answer in B"], prompt_rows, cls="grid prompts")  # fmt: skip
    fields = []
    for p in c.prompts:
        if p.fields:
            rows = [
                [
                    esc(path),
                    fmt_int(f.compared),
                    fmt_int(f.agree),
                    f'<span class="rate">{_rate(f.rate)}</span>',
                ]
                for path, f in p.fields.items()
            ]
            fields.append(f"<h3>{esc(p.prompt)}: field by field</h3>")
            fields.append(table(["field", "compared", "agree", "agreement"], rows, cls="grid fields"))
    notes = [
        f"<li>sources: {fmt_int(c.sources_shared)} shared ({fmt_int(c.sources_a)} in A, "
        f"{fmt_int(c.sources_b)} in B)</li>",
        f"<li>pages/frames: {fmt_int(c.units_shared)} shared, {fmt_int(c.units_only_a)} only in A, "
        f"{fmt_int(c.units_only_b)} only in B</li>",
    ]
    if c.prompts_only_a or c.prompts_only_b:
        notes.append(
            f"<li>prompts not compared: A only {esc(c.prompts_only_a)}, B only {esc(c.prompts_only_b)}</li>"
        )
    truncated = f"<p class='muted'>the first {fmt_int(len(c.pages))} are shown (--limit)</p>"
    return (
        f"<h1>compare {esc(a.id[:12])} (A) with {esc(b.id[:12])} (B)</h1>"
        f"{jobs_table}<ul>{''.join(notes)}</ul>"
        f"<h2>Agreement per prompt</h2>{prompts_table}{''.join(fields)}"
        f'<h2>Differing pages: <span id="differing-count">{fmt_int(c.differing_units)}</span></h2>'
        f"{truncated if c.pages_truncated else ''}"
    )


def _prompt_row(p: PromptAgreement) -> list[str]:
    cells = [p.units, p.compared, p.agree]
    rest = [p.differ, p.failed_a, p.failed_b, p.failed_both, p.missing_a, p.missing_b]
    return [
        esc(p.prompt),
        "JSON" if p.json_pairs else "text",
        *(f'<span class="num">{fmt_int(v)}</span>' for v in cells),
        f'<span class="num agreement">{_rate(p.rate)}</span>',
        *(f'<span class="num">{fmt_int(v)}</span>' for v in rest),
    ]


def _answer(d: DiffAnswer) -> str:
    fields = f'<div class="muted">differing fields: {esc(", ".join(d.fields))}</div>' if d.fields else ""
    a = render_answer_content(d.output_a, d.text_a, d.error_a) if d.outcome != "missing_a" else "(no answer)"
    b = render_answer_content(d.output_b, d.text_b, d.error_b) if d.outcome != "missing_b" else "(no answer)"
    return (
        f'<div class="answer diff-answer" data-outcome="{esc(d.outcome)}">'
        f'<div class="prompt">{esc(d.prompt)} '
        f'<span class="badge">{esc(OUTCOME_TITLES[d.outcome])}</span></div>'
        f'<div class="side"><div class="a"><div class="muted">A</div>{a}</div>'
        f'<div class="b"><div class="muted">B</div>{b}</div></div>{fields}</div>'
    )


def _diff_card(d: DiffPage) -> str:
    label = unit_label(d.kind, d.unit_index, d.timestamp)
    images = image_cell(d.unit_a, f"{label} (A)", d.image_a is not None)
    if d.image_b != d.image_a:
        images += image_cell(d.unit_b, f"{label} (B)", d.image_b is not None)
    head = (
        f'<div class="unit-head"><b>{esc(d.uri)}</b> · <b>{esc(label)}</b> · A {esc(d.status_a)}, '
        f"B {esc(d.status_b)}</div>"
    )
    answers = "".join(_answer(a) for a in d.answers)
    return f'<section class="unit diff"><div>{images}</div><div class="body">{head}{answers}</div></section>'


def write_compare_site(
    c: Comparison, store: ObjectStore, folder: Path, progress: Callable[[int], None] | None = None
) -> list[str]:
    """Write the report into ``folder``; returns the image keys missing from the store."""
    folder.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    total_pages = pages_needed(len(c.pages), DIFFS_PER_PAGE)
    summary = _summary(c)
    for n in range(1, total_pages + 1):
        chunk = c.pages[(n - 1) * DIFFS_PER_PAGE : n * DIFFS_PER_PAGE]
        for d in chunk:
            images = [(d.unit_a, d.image_a)]
            if d.image_b != d.image_a:
                images.append((d.unit_b, d.image_b))
            for unit_id, key in images:
                if key is None:
                    continue
                try:
                    copy_image(store, key, folder, unit_id)
                except ObjectNotFound:
                    log.warning("image %s is missing from the store", key)
                    missing.append(key)
        nav = pager(n, total_pages, diff_href)
        top = (
            summary
            if n == 1
            else f'<p><a href="index.html">← the figures</a></p><h1>Differing pages ({n})</h1>'
        )
        body = "\n".join([top, nav, *(_diff_card(d) for d in chunk), nav])
        title = f"compare {c.job_a.id[:12]} / {c.job_b.id[:12]}"
        (folder / diff_href(n)).write_text(page(title, body), "utf-8")
        if progress:
            progress(n)
    return missing
