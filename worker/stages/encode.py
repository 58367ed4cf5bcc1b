"""The encode stage: units -> visual tokens in the cache (a hit skips the tower), units marked encoded.

Transient errors (the store, the cache or the database away) propagate to the one runner
(worker.stages.runner) and never fail a unit while tries remain; the stage's `give_up`
(worker.stages.failures) records the real cause on the units once the last try has failed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ingest.budget import PixelBounds
from ingest.spec import JobSpec
from storage import repository as repo
from storage.rows import UnitTask
from worker import metrics
from worker.stages.needs import EncodeNeeds


@dataclass
class EncodeStep:
    encoded: list[UnitTask] = field(default_factory=list)  # with their cache key: to generate next
    failed: int = 0
    closed: dict[str, str] = field(default_factory=dict)


def shows_window_view(spec: JobSpec, has_window_view: bool) -> bool:
    """Whether the job's prompts may hold several images each shown on the family's window view
    (worker.models.base.ModelAdapter.has_window_view): windows of more than one unit."""
    plan = spec.window_plan()
    return has_window_view and plan is not None and plan.size != 1


def encode_units(rt: EncodeNeeds, units: list[UnitTask], spec: JobSpec) -> EncodeStep:
    """Make sure every unit's visual tokens are cached, in the tiers the job's cache policy uses
    (ingest.spec.CachePolicy), and their window view where the job's windows show it; units that
    can never be encoded fail."""
    step = EncodeStep()
    if not units:
        return step
    started = time.monotonic()
    store = rt.token_store.for_policy(spec.cache)
    keys = [(u.unit_id, u.image_key, PixelBounds.of(u.min_pixels, u.max_pixels)) for u in units]
    outcomes = store.encode_units(keys)
    if shows_window_view(spec, store.adapter.has_window_view):
        # A window of one image (a one-page source, a window alone at a source's end) shows the
        # usual view, every other window this one: both are cached, each encoded once.
        errors = {o.unit_id: o.error for o in store.encode_units(keys, window_view=True) if o.error}
        outcomes = [
            dataclasses.replace(o, cache_key=None, error=errors[o.unit_id]) if o.unit_id in errors else o
            for o in outcomes
        ]
    by_id = {u.unit_id: u for u in units}
    ok = [(o.unit_id, o.cache_key, o.cache_hit) for o in outcomes if o.error is None]
    failed = [(o.unit_id, o.error) for o in outcomes if o.error is not None]
    if ok:
        repo.mark_units_encoded(rt.db, ok)
    step.encoded = [
        dataclasses.replace(by_id[unit_id], cache_key=key, cache_hit=hit) for unit_id, key, hit in ok
    ]
    step.failed = len(failed)
    metrics.UNITS.labels("encode", "ok").inc(len(ok))
    metrics.UNITS.labels("encode", "failed").inc(len(failed))
    metrics.ERRORS.labels("encode", "unit").inc(len(failed))
    if failed:
        step.closed = repo.close_finished(rt.db, repo.fail_units(rt.db, failed))
    seconds = time.monotonic() - started
    metrics.STAGE_BUSY.labels("encode").inc(seconds)
    for job_id in {u.job_id for u in units}:
        repo.add_stage_seconds(rt.db, job_id, "encode", seconds)
    return step
