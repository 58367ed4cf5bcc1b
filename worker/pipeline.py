"""The embedded pipeline: ingest -> encode -> generate -> persist, in-process, for one job.

Each stage reads its work from the database and writes its outcome back, so the same stage
functions serve the Celery fleet; here they simply run one after the other.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ingest.budget import PixelBounds
from ingest.budget_rows import SourceBudget
from ingest.isolation import SourceInfo
from ingest.spec import JobSpec
from ingest.stage import check_source, expand_paths
from ingest.units import SourceError
from storage import repository as repo
from worker.generate import RequestRef
from worker.packing import padding_waste
from worker.runtime import Runtime

log = logging.getLogger(__name__)

UNIT_CHUNK = 64  # rows per insert: bounds memory on 2,000-page PDFs


class Progress(Protocol):
    def start(self, stage: str, total: int | None) -> None: ...

    def advance(self, stage: str, n: int = 1) -> None: ...

    def note(self, message: str) -> None: ...


class NullProgress:
    def start(self, stage: str, total: int | None) -> None:
        pass

    def advance(self, stage: str, n: int = 1) -> None:
        pass

    def note(self, message: str) -> None:
        log.info(message)


def ingest_job(rt: Runtime, job_id: str, paths: list[Path], spec: JobSpec, progress: Progress) -> None:
    """Sources are split in parallel (VISBATCH_INGEST_WORKERS), each thread with its own child process."""
    files = expand_paths(paths)
    progress.start("ingest", len(files))
    sources = [(repo.add_source(rt.db, job_id, str(path)), path) for path in files]

    def one(item: tuple[int, Path]) -> None:
        ingest_one(rt, job_id, item[0], item[1], spec)
        progress.advance("ingest")

    with ThreadPoolExecutor(max_workers=rt.settings.ingest_workers, thread_name_prefix="ingest") as pool:
        list(pool.map(one, sources))


@dataclass(frozen=True)
class IngestOutcome:
    error: str | None = None
    kind: str | None = None
    sha256: str | None = None
    size: int | None = None


def ingest_units(rt: Runtime, job_id: str, source_id: int, path: Path, spec: JobSpec) -> IngestOutcome:
    """Split one source (in this thread's child process) into unit rows, stored in chunks.

    The caller records the source's outcome.
    """
    try:
        check_source(path, rt.limits)
    except SourceError as exc:
        return IngestOutcome(error=str(exc))
    info: SourceInfo | None = None
    chunk: list[repo.UnitRow] = []
    items = rt.splitter().split(path, spec.ingest)
    try:
        first = next(items)
        assert isinstance(first, SourceInfo)
        info = first
        # The job's visual-token budget: bounds per unit, skipped frames, the per-video cap.
        budget = SourceBudget.for_job(spec, rt.adapter)
        for row in budget.rows(items, info.kind, rt.limits.max_visual_tokens):
            chunk.append(row)
            if len(chunk) >= UNIT_CHUNK:
                repo.add_units(rt.db, job_id, source_id, chunk)
                chunk = []
    except SourceError as exc:
        error: str | None = str(exc)
    else:
        error = None
    if chunk:  # units done before a failure are kept
        repo.add_units(rt.db, job_id, source_id, chunk)
    if info is None:
        return IngestOutcome(error=error)
    return IngestOutcome(error=error, kind=info.kind, sha256=info.sha256, size=info.size)


def ingest_one(rt: Runtime, job_id: str, source_id: int, path: Path, spec: JobSpec) -> None:
    outcome = ingest_units(rt, job_id, source_id, path, spec)
    facts = {"kind": outcome.kind, "sha256": outcome.sha256, "size": outcome.size}
    if outcome.error:
        repo.fail_source(rt.db, source_id, outcome.error, **facts)
    else:
        repo.mark_source_ingested(rt.db, source_id, **facts)


def encode_job(rt: Runtime, job_id: str, progress: Progress) -> None:
    units = repo.units_to_encode(rt.db, job_id)
    progress.start("encode", len(units))
    step = max(1, rt.settings.encode_batch_images)
    hits = misses = 0
    written_before = rt.cache.stats.bytes_written
    for start in range(0, len(units), step):
        chunk = units[start : start + step]
        outcomes = rt.tokens.encode_units([(u.unit_id, u.image_key, unit_bounds(u)) for u in chunk])
        hits += sum(o.cache_hit for o in outcomes if o.error is None)
        misses += sum(not o.cache_hit for o in outcomes if o.error is None)
        ok = [(o.unit_id, o.cache_key, o.cache_hit) for o in outcomes if o.error is None]
        failed = [(o.unit_id, o.error) for o in outcomes if o.error is not None]
        if ok:
            repo.mark_units_encoded(rt.db, ok)
        if failed:
            repo.fail_units(rt.db, failed)
        progress.advance("encode", len(chunk))
    written = (rt.cache.stats.bytes_written - written_before) / 1e6
    progress.note(
        f"token cache: {hits} hits, {misses} misses, {written:.1f} MB written; "
        f"vision tower ran {rt.tokens.stats.tower_calls} batches"
    )


def unit_bounds(unit: repo.UnitTask) -> PixelBounds | None:
    """The resize bounds the unit was counted with at ingest (its job's budget); None: the model's."""
    return PixelBounds.of(unit.min_pixels, unit.max_pixels)


def requests_for(units: list[repo.UnitTask], specs: dict[str, JobSpec]) -> list[RequestRef]:
    """Every unit asked every prompt of its job."""
    return [
        RequestRef(
            u.job_id,
            u.unit_id,
            p,
            u.image_key,
            u.visual_tokens,
            bool(u.cache_hit),
            specs[u.job_id],
            bounds=unit_bounds(u),
        )  # fmt: skip
        for u in units
        for p in range(len(specs[u.job_id].prompts))
    ]


def generate_and_store(rt: Runtime, requests: list[RequestRef], progress: Progress) -> dict[str, int]:
    """Pack, generate, upsert; finish each unit once all its requests here are answered.

    Every prompt of a unit must be in `requests`. Returns the pending count of each job whose
    units were finished, so the caller can close the jobs that reached 0.
    """
    stage = rt.generate_stage
    batches = stage.plan(requests)
    if batches:
        waste = padding_waste(batches)
        progress.note(f"{len(requests)} requests in {len(batches)} batches, padding {waste:.1%}")
    open_requests = Counter((r.job_id, r.unit_id) for r in requests)
    remaining: dict[str, int] = {}
    for batch in batches:
        pairs = stage.run_batch(batch)
        by_job: dict[str, list[repo.ResultRow]] = defaultdict(list)
        finished: dict[str, list[int]] = defaultdict(list)
        for ref, row in pairs:
            by_job[ref.job_id].append(row)
            open_requests[(ref.job_id, ref.unit_id)] -= 1
            if open_requests[(ref.job_id, ref.unit_id)] == 0:
                finished[ref.job_id].append(ref.unit_id)
        for job_id, rows in by_job.items():
            repo.upsert_results(rt.db, job_id, rows)
        for job_id, unit_ids in finished.items():
            remaining[job_id] = repo.finish_units(rt.db, job_id, unit_ids)
        progress.advance("generate", len(pairs))
    return remaining


def generate_job(rt: Runtime, job_id: str, spec: JobSpec, progress: Progress) -> None:
    requests = requests_for(repo.units_to_generate(rt.db, job_id), {job_id: spec})
    progress.start("generate", len(requests))
    generate_and_store(rt, requests, progress)


def run_job(rt: Runtime, paths: list[Path], spec: JobSpec, progress: Progress | None = None) -> str:
    """Run a whole job in this process; returns its id. The job always ends in a final state."""
    progress = progress or NullProgress()
    job_spec = spec.model_copy(update={"model": rt.model_name})
    job_id = repo.create_job(rt.db, job_spec.model_dump(mode="json"), status="running")
    progress.note(f"job {job_id}")
    try:
        ingest_job(rt, job_id, paths, spec, progress)
        encode_job(rt, job_id, progress)
        generate_job(rt, job_id, spec, progress)
    except KeyboardInterrupt:
        repo.set_job_status(rt.db, job_id, "cancelled", error="interrupted (Ctrl-C); finished work is kept")
        raise
    except Exception as exc:
        # A bug or a dead service: record it, so `visbatch status` explains what happened.
        repo.set_job_status(rt.db, job_id, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    repo.close_job(rt.db, job_id)
    return job_id
