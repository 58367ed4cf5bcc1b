"""Tokens a job spent and saved, counted from its unit and result rows (two aggregate queries + one).

spent:  visual      tokens of the job's pages and frames encoded (each encoded once, asked every
                    prompt); a page or frame stored but not encoded yet (a stopped job) is not
                    spent: its planned tokens are `visual_not_encoded` (`units_not_encoded` of them)
        visual_to_lm  visual tokens the language model was given, over all requests (after merging
                      and pruning)
        prompt / completion   text tokens in and out, over all requests
saved:  detail          per page/frame: tokens at the model's own resize bounds minus tokens at
                        the job's (detail preset, --max-pixels, token caps)
        skipped_frames  per skipped frame: its tokens at the model's own bounds
        cache_hits      vision-tower tokens not computed: units whose tokens came from the cache
                        (another job, or an identical page or frame earlier in this job)
        pruning         visual tokens left out of the LM input, over all requests
        merging         visual tokens merged into a neighbour before the LM, over all requests
without_budget = visual + detail + skipped_frames: what the pages and frames would have cost at
the model's own bounds with every frame kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, case, false, func, select, true

from storage.models import RESULTS, UNITS, UnitStatus

# Through the vision tower (or served by the cache): a failed unit's tokens are not counted (it
# may never have been encoded), a pending one's are only planned.
_SPENDING = (UnitStatus.ENCODED.value, UnitStatus.DONE.value)


@dataclass(frozen=True, slots=True)
class ResultSums:
    """A job's results summed in one pass: what `status` shows and the token report's share."""

    total: int
    failed: int
    to_lm: int
    pruned: int
    merged: int
    prompt: int
    completion: int
    written_since: int  # results written (or rewritten) since `since` (all of them without one)


def result_sums(session: Connection, job_id: str, since: datetime | None = None) -> ResultSums:
    """One aggregate over the job's results (at 10 million rows each pass is seconds: status of a
    running job makes one, not two; docs/scale.md). ``since``: also count the results written
    since then (a resumed job's rate is this run's, not the first run's)."""
    r = RESULTS.c
    written = func.count() if since is None else func.coalesce(func.sum(case((r.updated_at >= since, 1))), 0)
    stmt = select(
        func.count(),
        func.count(r.error),
        func.coalesce(func.sum(r.visual_tokens - r.pruned_tokens - r.merged_tokens), 0),
        func.coalesce(func.sum(r.pruned_tokens), 0),
        func.coalesce(func.sum(r.merged_tokens), 0),
        func.coalesce(func.sum(r.prompt_tokens), 0),
        func.coalesce(func.sum(r.completion_tokens), 0),
        written,
    ).where(r.job_id == job_id)
    return ResultSums(*(int(v) for v in session.execute(stmt).one()))


def token_report(session: Connection, job_id: str, sums: ResultSums | None = None) -> dict[str, Any]:
    """The report; ``sums``: the job's result_sums when the caller has them already."""
    u = UNITS.c
    spending = u.status.in_(_SPENDING)
    planned = u.status == UnitStatus.PENDING.value
    skipped = u.status == UnitStatus.SKIPPED.value
    visual = func.coalesce(u.visual_tokens, 0)
    full = func.coalesce(u.full_tokens, u.visual_tokens, 0)
    units_stmt = select(
        func.coalesce(func.sum(case((spending, visual), else_=0)), 0),
        func.coalesce(func.sum(case((spending, full - visual), else_=0)), 0),
        func.coalesce(func.sum(case((skipped, 1), else_=0)), 0),
        func.coalesce(func.sum(case((skipped, full), else_=0)), 0),
        func.coalesce(func.sum(case((u.cache_hit == true(), 1), else_=0)), 0),
        func.coalesce(func.sum(case((u.cache_hit == true(), visual), else_=0)), 0),
        func.coalesce(func.sum(case((u.cache_hit == false(), 1), else_=0)), 0),
        func.coalesce(func.sum(case((planned, 1), else_=0)), 0),
        func.coalesce(func.sum(case((planned, visual), else_=0)), 0),
    ).where(u.job_id == job_id)
    (
        spent_visual,
        saved_detail,
        n_skipped,
        saved_skipped,
        hits,
        hit_tokens,
        misses,
        n_planned,
        planned_visual,
    ) = (int(v) for v in session.execute(units_stmt).one())
    # Units that share an image (and bounds) with another unit of the job: identical pages or
    # frames, across sources or within one; all but the first of each are cache hits.
    encoded = (
        select(u.image_key, u.min_pixels, u.max_pixels, func.count().label("n"))
        .where(u.job_id == job_id, u.cache_key.is_not(None))
        .group_by(u.image_key, u.min_pixels, u.max_pixels)
        .subquery()
    )
    distinct, with_key = session.execute(select(func.count(), func.coalesce(func.sum(encoded.c.n), 0))).one()
    sums = sums or result_sums(session, job_id)
    to_lm, pruned, merged, prompt, completion = (
        sums.to_lm,
        sums.pruned,
        sums.merged,
        sums.prompt,
        sums.completion,
    )
    return {
        "spent": {"visual": spent_visual, "visual_to_lm": to_lm, "prompt": prompt, "completion": completion},
        "saved": {
            "detail": saved_detail,
            "skipped_frames": saved_skipped,
            "cache_hits": hit_tokens,
            "pruning": pruned,
            "merging": merged,
        },
        "without_budget": spent_visual + saved_detail + saved_skipped,
        "units_skipped": n_skipped,
        "cache_hit_units": hits,
        "cache_miss_units": misses,
        "identical_images": int(with_key) - int(distinct),
        "units_not_encoded": n_planned,
        "visual_not_encoded": planned_visual,
    }
