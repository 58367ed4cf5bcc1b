"""The ingest stage: one source (or one range of a PDF's pages) split into stored units.

The source is split in this thread's sandboxed child (ingest.isolation); its units are counted
under the job's visual-token budget (ingest.budget_rows, the model's token rule from its JSON
files: no torch) and stored in small chunks, each handed at once to `on_units`, so the first
page reaches the encoder while later pages still render. When the source is complete its hold
on the job's countdown is released, and the job closed if that was the last thing it waited for.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from ingest.budget_rows import SourceBudget
from ingest.isolation import SourceInfo, SplitterOutOfStep, StoredUnit
from ingest.spec import JobSpec
from ingest.stage import check_source
from ingest.units import SourceError, UnitFailure, UnitSelection
from storage import repository as repo
from storage.db import Database
from storage.rows import UnitRow, UnitTask
from worker import metrics
from worker.stages.needs import IngestNeeds

UNIT_CHUNK = 64  # rows per insert: bounds memory on 2,000-page PDFs
FLUSH_SECONDS = 0.5  # a chunk goes on to encode at most this long after its first unit

OnUnits = Callable[[list[UnitTask]], None]


@dataclass
class IngestStep:
    units_stored: int = 0
    # Where the next range of pages starts (a fleet task hands it on); None: nothing left.
    next_position: int | None = None
    stopped: bool = False  # the run is stopping: the source stays pending, to be resumed
    completed: bool = False  # the source is split to its end (or failed): its last windows are known
    closed: dict[str, str] = field(default_factory=dict)  # jobs this step closed -> status


class _Chunks:
    """Stores rows in chunks (by count or age) and hands each chunk's pending units on."""

    def __init__(self, db: Database, job_id: str, source_id: int, uri: str, on_units: OnUnits | None) -> None:
        self.db, self.job_id, self.source_id, self.uri = db, job_id, source_id, uri
        self.on_units = on_units
        self.kind: str | None = None
        self.sha256: str | None = None  # the file the rows come from (pinned on the source)
        self.rows: list[UnitRow] = []
        self.first_at = 0.0
        self.stored = 0

    def add(self, row: UnitRow) -> None:
        if not self.rows:
            self.first_at = time.monotonic()
        self.rows.append(row)
        if len(self.rows) >= UNIT_CHUNK or time.monotonic() - self.first_at >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        ids = repo.add_units(self.db, self.job_id, self.source_id, rows, sha256=self.sha256)
        self.stored += len(rows)
        for row in rows:
            outcome = "failed" if row.error else "skipped" if row.skip_reason else "ok"
            metrics.UNITS.labels("ingest", outcome).inc()
            if row.error:
                metrics.ERRORS.labels("ingest", "unit").inc()
        pending = [
            UnitTask(
                unit_id=unit_id,
                job_id=self.job_id,
                source_id=self.source_id,
                source_uri=self.uri,
                kind=self.kind,
                index=row.index,
                image_key=row.image_key,
                visual_tokens=row.visual_tokens,
                width=row.width,
                height=row.height,
                cache_key=None,
                cache_hit=None,
                timestamp=row.timestamp,
                min_pixels=row.min_pixels,
                max_pixels=row.max_pixels,
            )  # fmt: skip
            for unit_id, row in zip(ids, rows, strict=True)
            if row.error is None and row.skip_reason is None
        ]
        if pending and self.on_units is not None:
            self.on_units(pending)


@contextlib.contextmanager
def local_copy(rt: IngestNeeds, location: str) -> Iterator[Path]:
    """A local path for a source: as is (a path, or file:// on a shared folder), or streamed from the
    object store (store:<key>, a file `visbatch submit` uploaded) or S3 to a temporary file."""
    if location.startswith("file://"):
        yield Path(urlparse(location).path)
        return
    if not location.startswith(("store:", "s3://")):
        yield Path(location)
        return
    from storage.object_store import download_s3_uri

    with tempfile.TemporaryDirectory(prefix="visbatch-src-") as tmp:
        dest = Path(tmp) / "source"
        if location.startswith("store:"):
            rt.store.download_file(location.removeprefix("store:"), dest)
        elif location.startswith("s3://"):
            # A user's object: any key name (spaces, accents), not one of visbatch's own keys.
            download_s3_uri(location, dest, endpoint_url=rt.settings.s3_endpoint_url)
        else:
            raise ValueError(f"unknown source location {location!r}")
        yield dest


def ingest_source(
    rt: IngestNeeds,
    job_id: str,
    source_id: int,
    uri: str,
    path: Path,
    spec: JobSpec,
    *,
    selection: UnitSelection | None = None,
    on_units: OnUnits | None = None,
    stop: threading.Event | None = None,
    stop_after_s: float | None = None,
) -> IngestStep:
    """Split `path` (the source `uri` of the job) into stored units, those `selection` picks.

    Units that fail alone (a page that does not render) are stored failed; a source that cannot
    be read at all fails with the reason. A transient error (the database away) is raised for
    the retry policy: rows are upserted, so a retried step redoes nothing twice. After
    `stop_after_s` seconds, a range of a PDF's pages ends early (slow pages): `next_position`
    then says where the rest starts.
    """
    selection = selection or UnitSelection()
    started = time.monotonic()
    seen = 0  # rows read from the child: one per page of the range (no skip with a time budget)
    step = IngestStep()
    chunks = _Chunks(rt.db, job_id, source_id, uri, on_units)
    info: SourceInfo | None = None
    error: str | None = None
    try:
        check_source(path, rt.limits)
        with contextlib.closing(rt.splitter().split(path, spec.ingest, selection)) as items:
            # closing: a step that ends early (an error below, a stop, a spent time budget) kills
            # the child at once, so its unread replies can never reach the next source.
            first = next(items, None)
            if not isinstance(first, SourceInfo):
                raise SplitterOutOfStep(f"the splitting process did not start with {path.name}'s facts")
            info = first
            chunks.kind, chunks.sha256 = info.kind, info.sha256
            plan = spec.window_plan()
            if plan is not None and plan.by_time and info.kind != "video":
                raise SourceError(
                    f"--window {spec.window} counts seconds of video, and this is a {info.kind}"
                )
            # The job's visual-token budget: bounds per unit, skipped frames, the per-video cap.
            budget = SourceBudget.for_job(spec, rt.token_rule)
            timed = stop_after_s is not None and info.units is not None and not selection.skip
            for row in budget.rows(_in_order(items, path), info.kind, rt.limits.max_visual_tokens):
                chunks.add(row)
                seen += 1
                if stop is not None and stop.is_set():
                    step.stopped = True
                    break
                if (
                    timed
                    and time.monotonic() - started > stop_after_s
                    and seen < _range_size(selection, info)
                ):
                    step.next_position = selection.first + seen  # closing kills the rest of the range
                    break
    except SourceError as exc:
        error = str(exc)
    except repo.SourceChanged as exc:
        chunks.rows.clear()  # rows of the second file are never stored beside the first one's
        error = str(exc)
    finally:
        try:
            chunks.flush()  # units done before a failure (or a stop) are kept
        except repo.SourceChanged as exc:
            error = str(exc)  # the file was replaced since an earlier range: the source fails
        step.units_stored = chunks.stored
        busy = time.monotonic() - started
        metrics.STAGE_BUSY.labels("ingest").inc(busy)
        repo.add_stage_seconds(rt.db, job_id, "ingest", busy)
    if stop is not None and stop.is_set():
        step.stopped = True  # a failure caused by the stop (the child killed) is no failure
        return step
    if error is None and info is not None and info.units is not None and step.next_position is None:
        end = selection.first + (selection.limit if selection.limit is not None else info.units)
        if end < info.units:
            step.next_position = end
    if error is None and step.next_position is not None:
        return step
    if error is not None:
        metrics.ERRORS.labels("ingest", "source").inc()
    facts = {"kind": info.kind, "sha256": info.sha256, "size": info.size} if info else {}
    remaining = repo.complete_source(rt.db, source_id, error=error, **facts)
    step.completed = True
    step.closed = repo.close_finished(rt.db, remaining)
    return step


def _in_order(
    items: Iterator[SourceInfo | StoredUnit | UnitFailure], path: Path
) -> Iterator[StoredUnit | UnitFailure]:
    """The child's units, checked before any is stored: each a page or frame (never a second
    source's facts), in increasing order, none twice. The reader already checks that each reply
    answers this request and carries this file's hash; this catches a child that misbehaves."""
    last = -1
    for item in items:
        if not isinstance(item, StoredUnit | UnitFailure) or item.index <= last:
            raise SplitterOutOfStep(f"the splitting process reported units of {path.name} out of order")
        last = item.index
        yield item


def _range_size(selection: UnitSelection, info: SourceInfo) -> int:
    """Pages in this range of the source."""
    total = info.units or 0
    end = total if selection.limit is None else min(total, selection.first + selection.limit)
    return max(0, end - selection.first)
