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
from storage import repository as repo
from storage.rows import UnitTask
from worker import metrics
from worker.stages.needs import EncodeNeeds


@dataclass
class EncodeStep:
    encoded: list[UnitTask] = field(default_factory=list)  # with their cache key: to generate next
    failed: int = 0
    closed: dict[str, str] = field(default_factory=dict)


def encode_units(rt: EncodeNeeds, units: list[UnitTask], cache: str = "cold") -> EncodeStep:
    """Make sure every unit's visual tokens are cached, in the tiers the job's cache policy uses
    (`cache`: ingest.spec.CachePolicy); units that can never be encoded fail."""
    step = EncodeStep()
    if not units:
        return step
    started = time.monotonic()
    outcomes = rt.token_store.for_policy(cache).encode_units(
        [(u.unit_id, u.image_key, PixelBounds.of(u.min_pixels, u.max_pixels)) for u in units]
    )
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
