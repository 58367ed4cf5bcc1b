"""The storage API in one namespace: ``from storage import repository as repo``.

Each concept lives in its own module (storage.jobs, storage.sources, storage.units,
storage.results, storage.claims, over the shared SQL of storage.sql, whose docstring states
the counting rules); this module only gathers their public names.
"""

from storage.claims import ClaimRow, claim_keys, claim_object, find_claim, release_claim, set_claim
from storage.jobs import (
    STAGES,
    ReopenedJob,
    StartedJob,
    add_stage_seconds,
    close_finished,
    close_job,
    create_job,
    finished_among,
    job_counts_by_status,
    job_state,
    job_summary,
    list_jobs,
    reopen_job,
    resolve_job_id,
    set_job_status,
    start_job,
)
from storage.models import DROP_CLAIMS, JOBS, RESULTS, SOURCES, UNITS
from storage.results import (
    answered_prompts,
    count_results,
    iter_results,
    preview_results,
    store_results,
    upsert_results,
)
from storage.rows import ResultRow, UnitRow, UnitTask
from storage.sources import (
    SourceState,
    add_source,
    advance_cursor,
    complete_source,
    pending_sources,
    source_state,
    stored_unit_indexes,
)
from storage.sql import JobNotFound, NotFound, SourceNotFound
from storage.units import (
    add_units,
    fail_units,
    finish_units,
    mark_units_encoded,
    units_by_ids,
    units_in_state,
)

__all__ = [
    "DROP_CLAIMS",
    "JOBS",
    "RESULTS",
    "SOURCES",
    "STAGES",
    "UNITS",
    "ClaimRow",
    "JobNotFound",
    "NotFound",
    "ReopenedJob",
    "ResultRow",
    "SourceNotFound",
    "SourceState",
    "StartedJob",
    "UnitRow",
    "UnitTask",
    "add_source",
    "add_stage_seconds",
    "add_units",
    "advance_cursor",
    "answered_prompts",
    "claim_keys",
    "claim_object",
    "close_finished",
    "close_job",
    "complete_source",
    "count_results",
    "create_job",
    "fail_units",
    "find_claim",
    "finish_units",
    "finished_among",
    "iter_results",
    "job_counts_by_status",
    "job_state",
    "job_summary",
    "list_jobs",
    "mark_units_encoded",
    "pending_sources",
    "preview_results",
    "release_claim",
    "reopen_job",
    "resolve_job_id",
    "set_claim",
    "set_job_status",
    "source_state",
    "start_job",
    "store_results",
    "stored_unit_indexes",
    "units_by_ids",
    "units_in_state",
    "upsert_results",
]
