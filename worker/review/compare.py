"""Two runs over the same sources and prompts, answer by answer: how often they agree, what each
spent in visual tokens, and the pages where they differ.

This is how a user decides, with no gold labels, whether a cheaper run (``--detail low``, a
smaller model, pruning) is safe on their own documents: if it agrees with the expensive run on
nearly every page, it is.

Matching: units by source uri and unit index (pages and frames of the same file with the same
sampling), prompts by their exact text (their order may differ). Per prompt, each shared unit
ends in one outcome:

    agree / differ   both answered; text compared exactly (outer whitespace ignored), JSON outputs
                     compared as values, and field by field (every leaf path of either output)
    failed_a / failed_b / failed_both   an answer has an error (engine failure, schema error)
    missing_a / missing_b               no answer in one run: the unit was skipped (a near-duplicate
                                        frame), failed before generation, or is still pending

A page "differs" when any shared prompt's outcome is differ, failed_a/b or missing_a/b.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from storage.db import Database
from storage.review import (
    Answer,
    JobInfo,
    UnitPair,
    iter_unit_pairs,
    job_sources,
    load_job,
    matched_visual_tokens,
    shared_sources,
    unmatched_units,
)

DIFFERING = {"differ", "failed_a", "failed_b", "missing_a", "missing_b"}
DEFAULT_PAGE_LIMIT = 1000


class CompareError(ValueError):
    """The two jobs cannot be compared (no shared sources or prompts, the same job twice ...)."""


@dataclass
class FieldAgreement:
    compared: int = 0
    agree: int = 0

    @property
    def rate(self) -> float | None:
        return self.agree / self.compared if self.compared else None


@dataclass
class PromptAgreement:
    prompt: str
    index_a: int
    index_b: int
    units: int = 0
    agree: int = 0
    differ: int = 0
    failed_a: int = 0
    failed_b: int = 0
    failed_both: int = 0
    missing_a: int = 0
    missing_b: int = 0
    json_pairs: int = 0
    fields: dict[str, FieldAgreement] = field(default_factory=dict)

    @property
    def compared(self) -> int:
        """Units where both runs answered without error."""
        return self.agree + self.differ

    @property
    def rate(self) -> float | None:
        return self.agree / self.compared if self.compared else None

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "fields"}
        data["compared"] = self.compared
        data["agreement"] = self.rate
        data["kind"] = "json" if self.json_pairs else "text"
        data["fields"] = {
            path: {"compared": f.compared, "agree": f.agree, "agreement": f.rate}
            for path, f in self.fields.items()
        }
        return data


@dataclass
class DiffAnswer:
    prompt: str
    outcome: str
    output_a: Any
    output_b: Any
    text_a: str | None
    text_b: str | None
    error_a: str | None
    error_b: str | None
    fields: list[str]  # the JSON leaf paths that differ


@dataclass(frozen=True)
class DiffPage(UnitPair):
    """A page or frame of both jobs whose answers differ, with the answers that do."""

    answers: list[DiffAnswer] = field(default_factory=list)


@dataclass
class Comparison:
    job_a: JobInfo
    job_b: JobInfo
    prompts: list[PromptAgreement]
    prompts_only_a: list[str]
    prompts_only_b: list[str]
    sources_a: int
    sources_b: int
    sources_shared: int
    units_shared: int
    units_only_a: int
    units_only_b: int
    visual_tokens_shared: tuple[int, int]
    differing_units: int
    pages: list[DiffPage]

    @property
    def pages_truncated(self) -> bool:
        return self.differing_units > len(self.pages)

    def to_json(self) -> dict[str, Any]:
        def job(info: JobInfo, shared_visual: int) -> dict[str, Any]:
            return {
                "id": info.id,
                "status": info.status,
                "model": info.spec.get("model"),
                "budget": info.spec.get("budget"),
                "tokens_spent": info.tokens.get("spent"),
                "visual_tokens_on_shared_units": shared_visual,
            }

        return {
            "job_a": job(self.job_a, self.visual_tokens_shared[0]),
            "job_b": job(self.job_b, self.visual_tokens_shared[1]),
            "sources": {"a": self.sources_a, "b": self.sources_b, "shared": self.sources_shared},
            "units": {"shared": self.units_shared, "only_a": self.units_only_a, "only_b": self.units_only_b},
            "prompts": [p.to_json() for p in self.prompts],
            "prompts_only_a": self.prompts_only_a,
            "prompts_only_b": self.prompts_only_b,
            "differing_units": self.differing_units,
            "differing_pages": [asdict(p) for p in self.pages],
            "differing_pages_truncated": self.pages_truncated,
        }


# ---------------------------------------------------------------------------------------------
# Matching answers


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a JSON value with its path (``a.b``, ``items[2].price``; ``$`` for a scalar root).
    An empty object or list is a leaf itself, so {} against {"x": 1} still differs at ``x``."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield (path or "$", value)


def _same(a: Any, b: Any) -> bool:
    # JSON numbers compare by value (1 == 1.0), but Python's True == 1 must not make true agree with 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def compare_json(a: Any, b: Any) -> tuple[bool, dict[str, bool]]:
    """(whole outputs equal, {leaf path: equal}) over the union of both outputs' leaf paths."""
    left, right = dict(leaves(a)), dict(leaves(b))
    fields = {
        path: path in left and path in right and _same(left[path], right[path])
        for path in dict.fromkeys([*left, *right])
    }
    return all(fields.values()), fields


def _outcome(found_a: bool, found_b: bool, error_a: str | None, error_b: str | None) -> str | None:
    """The outcome unless both answered without error (None: compare the answers)."""
    if not found_a and not found_b:
        return "unanswered"
    if not found_a:
        return "missing_a"
    if not found_b:
        return "missing_b"
    if error_a is not None and error_b is not None:
        return "failed_both"
    if error_a is not None:
        return "failed_a"
    if error_b is not None:
        return "failed_b"
    return None


def _some(n: int, sample: list[str]) -> str:
    return f"{n} ({', '.join(sample) or 'none'}{', ...' if n > len(sample) else ''})"


def _check_comparable(db: Database, a: JobInfo, b: JobInfo) -> tuple[int, int, int]:
    if a.id == b.id:
        raise CompareError(f"JOB_A and JOB_B are the same job ({a.id}); give two runs")
    (n_a, sample_a), (n_b, sample_b) = job_sources(db, a.id), job_sources(db, b.id)
    shared = shared_sources(db, a.id, b.id)
    if not shared:
        raise CompareError(
            f"the jobs share no source (matched by uri): {a.id[:12]} has {_some(n_a, sample_a)}, "
            f"{b.id[:12]} has {_some(n_b, sample_b)}; compare two runs over the same inputs"
        )
    if not set(a.prompts) & set(b.prompts):
        raise CompareError(
            f"the jobs share no prompt (matched by exact text): {a.id[:12]} asks {a.prompts!r}, "
            f"{b.id[:12]} asks {b.prompts!r}"
        )
    return n_a, n_b, shared


def compare_jobs(db: Database, job_a: str, job_b: str, *, page_limit: int = DEFAULT_PAGE_LIMIT) -> Comparison:
    """Compare two jobs (ids or unique prefixes); keeps the first ``page_limit`` differing pages
    (in source uri, unit order) with their answers; every count covers all of them."""
    a, b = load_job(db, job_a), load_job(db, job_b)
    sources_a, sources_b, sources_shared = _check_comparable(db, a, b)
    b_index: dict[str, int] = {}
    for i, prompt in enumerate(b.prompts):
        b_index.setdefault(prompt, i)  # a prompt repeated in one job: its first occurrence
    prompts: list[PromptAgreement] = []
    for i, prompt in enumerate(a.prompts):
        if prompt in b_index and all(p.prompt != prompt for p in prompts):
            prompts.append(PromptAgreement(prompt, i, b_index[prompt]))
    units_shared = differing = 0
    pages: list[DiffPage] = []
    for row, answers_a, answers_b in iter_unit_pairs(db, a.id, b.id):
        units_shared += 1
        diffs = []
        for agreement in prompts:
            # Matched by turn and by what the answer covers (a window's last unit), too.
            covers = {(t, u) for p, t, u in answers_a if p == agreement.index_a}
            covers |= {(t, u) for p, t, u in answers_b if p == agreement.index_b}
            for turn, last in sorted(covers, key=_covers_order) or [(0, None)]:
                answer_a = answers_a.get((agreement.index_a, turn, last))
                answer_b = answers_b.get((agreement.index_b, turn, last))
                diff = _judge(agreement, answer_a, answer_b)
                if diff is not None:
                    diffs.append(diff)
        if not diffs:
            continue
        differing += 1
        if len(pages) < page_limit:
            pages.append(DiffPage(**asdict(row), answers=diffs))
    if units_shared == 0:
        raise CompareError(
            f"the jobs share {sources_shared} source(s) but no page or frame (same uri and index): "
            "were they sampled differently (--pages, --fps, --num-frames)?"
        )
    return Comparison(
        job_a=a,
        job_b=b,
        prompts=prompts,
        prompts_only_a=[p for p in a.prompts if p not in b_index],
        prompts_only_b=[p for p in b.prompts if p not in set(a.prompts)],
        sources_a=sources_a,
        sources_b=sources_b,
        sources_shared=sources_shared,
        units_shared=units_shared,
        units_only_a=unmatched_units(db, a.id, b.id),
        units_only_b=unmatched_units(db, b.id, a.id),
        visual_tokens_shared=matched_visual_tokens(db, a.id, b.id),
        differing_units=differing,
        pages=pages,
    )


def _covers_order(covers: tuple[int, int | None]) -> tuple[int, int]:
    """Turns in order, a unit's own answer before the windows it starts."""
    turn, last = covers
    return turn, -1 if last is None else last


def _judge(agreement: PromptAgreement, a: Answer | None, b: Answer | None) -> DiffAnswer | None:
    """Count one unit's answers to one prompt; a DiffAnswer when they differ, else None."""
    outcome = _outcome(a is not None, b is not None, a and a.error, b and b.error)
    fields: list[str] = []
    if outcome is None:
        assert a is not None and b is not None
        if a.output is not None and b.output is not None:
            agreement.json_pairs += 1
            same, per_field = compare_json(a.output, b.output)
            for path, equal in per_field.items():
                stats = agreement.fields.setdefault(path, FieldAgreement())
                stats.compared += 1
                stats.agree += equal
            fields = [path for path, equal in per_field.items() if not equal]
        else:
            same = (a.text or "").strip() == (b.text or "").strip()
        outcome = "agree" if same else "differ"
    if outcome != "unanswered":
        agreement.units += 1
        setattr(agreement, outcome, getattr(agreement, outcome) + 1)
    if outcome not in DIFFERING:
        return None
    return DiffAnswer(
        prompt=agreement.prompt,
        outcome=outcome,
        output_a=a.output if a else None,
        output_b=b.output if b else None,
        text_a=a.text if a else None,
        text_b=b.text if b else None,
        error_a=a.error if a else None,
        error_b=b.error if b else None,
        fields=fields,
    )


# ---------------------------------------------------------------------------------------------
# Terminal output


def terminal_safe(text: str | None, width: int = 60) -> str:
    """Model output for a terminal: control characters (escape sequences could restyle or rewrite
    the screen) shown as a placeholder, newlines as ⏎, cut to ``width``."""
    if text is None:
        return ""
    text = text.replace("\n", " ⏎ ")
    cleaned = "".join("�" if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in text)
    return cleaned if len(cleaned) <= width else cleaned[: width - 1] + "…"


def answer_summary(output: Any, text: str | None, error: str | None) -> str:
    if error is not None:
        return f"error: {error}"
    if output is not None:
        return json.dumps(output, ensure_ascii=False, sort_keys=True)
    return text if text is not None else "(no answer)"
