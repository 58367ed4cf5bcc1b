"""What the generate stage is handed and answers: one job's units (read, or named by id), the
ticket its submitter waits on, and what became of them."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ingest.spec import JobSpec
from storage.rows import UnitTask, WindowTask
from storage.summaries import SourceTask


@dataclass(frozen=True)
class UnitsOutcome:
    """What became of the units of one submission."""

    stored: int = 0  # units whose results are stored (and marked done)
    dropped: int = 0  # units of a job that was cancelled or finished meanwhile


class ServiceClosed(RuntimeError):
    """The service stopped (the worker is shutting down) before these units were answered."""


@dataclass(frozen=True)
class JobUnits:
    """Units of one job, read already (the embedded run hands on what its encode step wrote)."""

    # Units; or a windowed job's windows, or a source to summarize (what the loop turns them into).
    units: list[UnitTask | WindowTask | SourceTask]
    spec: JobSpec

    @property
    def size(self) -> int:
        return len(self.units)


@dataclass(frozen=True)
class UnitIds:
    """Units of one job named by id (a fleet message): read, still encoded, with the batch they
    arrive in."""

    unit_ids: list[int]
    spec: JobSpec

    @property
    def size(self) -> int:
        return len(self.unit_ids)


# What `GenerateLoop.add_many` takes: one job's units or their ids, and the ticket whose Future
# their submitter waits on.
Submission = tuple["JobUnits | UnitIds", "Ticket | None"]


@dataclass
class Ticket:
    """One submission: its Future resolves once every one of its units is stored or dropped."""

    future: Future
    left: int
    stored: int = 0
    dropped: int = 0

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def settle(self, *, stored: bool) -> None:
        if stored:
            self.stored += 1
        else:
            self.dropped += 1
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(UnitsOutcome(self.stored, self.dropped))
