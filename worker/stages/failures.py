"""What a stage's failure means, for each stage: the shapes the one runner runs (worker.stages.runner).

The runner has decided the work will not be tried again (a permanent error, or the last try's);
the stage's `give_up` records it on the work's rows with the real cause, and the job goes on: a
source fails (its stored units stay), or units fail. Apart from the stages' own modules so that
a driver knows them without importing what a stage runs (generate's request building imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from storage import repository as repo
from storage.db import Database
from storage.models import UnitStatus
from worker import metrics
from worker.retry import failure_message
from worker.stages.runner import TimeLimitHit, UnitsWork


@dataclass(frozen=True, slots=True)
class SourceWork:
    """One source of a job to ingest (or a range of its pages)."""

    job_id: str
    source_id: int
    location: str  # where it is read: a path, store:<key>, s3://...


class IngestStage:
    """The source fails with the cause; its stored units stay."""

    name = "ingest"

    def job_of(self, work: SourceWork) -> str:
        return work.job_id

    def describe(self, work: SourceWork) -> str:
        return f"ingest {work.location}"

    def give_up(self, db: Database, work: SourceWork, exc: BaseException, tries: int) -> None:
        from storage.object_store import ObjectNotFound

        if isinstance(exc, TimeLimitHit):
            # A PDF's pages are split in ranges that end in time; a video is one step.
            message = (
                f"ingest failed: splitting took longer than the task time limit "
                f"(VISBATCH_TASK_TIME_LIMIT, {exc.limit_s:g} s): sample fewer frames "
                "(--max-frames, --fps) or raise the limit with VISBATCH_VISIBILITY_TIMEOUT above it"
            )
        elif isinstance(exc, ObjectNotFound):  # permanent: retrying will not make it appear
            message = f"not found: {work.location.removeprefix('store:')}"
        else:
            message = failure_message("ingest", exc, tries)
        metrics.ERRORS.labels("ingest", "source").inc()
        repo.close_finished(db, repo.complete_source(db, work.source_id, error=message))


class _UnitsStage:
    """The units still in the state this stage takes them in fail with the cause."""

    name: str
    takes: UnitStatus

    def job_of(self, work: UnitsWork) -> str:
        return work.job_id

    def describe(self, work: UnitsWork) -> str:
        return f"{self.name} {len(work.unit_ids)} units"

    def give_up(self, db: Database, work: UnitsWork, exc: BaseException, tries: int) -> None:
        message = failure_message(self.name, exc, tries)
        left = repo.units_by_ids(db, work.unit_ids, self.takes)
        metrics.ERRORS.labels(self.name, "retries_exhausted").inc(len(left))
        repo.close_finished(db, repo.fail_units(db, [(u.unit_id, message) for u in left]))


class EncodeStage(_UnitsStage):
    name = "encode"
    takes = UnitStatus.PENDING


class GenerateStage(_UnitsStage):
    name = "generate"
    takes = UnitStatus.ENCODED


INGEST = IngestStage()
ENCODE = EncodeStage()
GENERATE = GenerateStage()
