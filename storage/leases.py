"""A run's lease on its job: how a job run in one process is known to be alive, wherever it runs.

A pid tells nothing across containers: each run may be pid 1 of its own PID namespace under a host
name others share. So the run (worker.drivers.run_lease) holds a lease in the job row, renewed every
few seconds; a reader calls the job `interrupted` once the lease has expired, and `visbatch resume`
takes over only a run that is gone. Taking the lease is a compare-and-swap on what the taker saw
(holder and renewal), so two resumes, or a resume and a late renewal, never both win; and a run
writes its job's final status only while it holds the lease (`end_held`).

Times are the writers' clocks: hosts must agree within a few seconds (NTP), well inside a lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update

from storage.db import Database
from storage.models import FINISHED_JOB_STATUSES, JOBS, JobStatus, utcnow
from storage.sql import JobNotFound, iso, now_param


@dataclass(frozen=True, slots=True)
class Lease:
    """What the job row says of the run that holds it."""

    job_id: str
    status: str
    holder: str | None
    renewed_at: datetime | None
    expires_at: datetime | None
    process: str | None  # "HOST:PID:START:NS" of the run (worker.drivers.job_activity)

    def live(self, now: datetime | None = None) -> bool:
        """Held, and renewed recently enough (a released or expired lease is not)."""
        return self.holder is not None and self.expires_at is not None and self.expires_at > (now or utcnow())

    def view(self) -> dict[str, Any] | None:
        return lease_view(self.holder, self.renewed_at, self.expires_at)


def lease_view(
    holder: str | None, renewed_at: datetime | None, expires_at: datetime | None
) -> dict[str, Any] | None:
    """The lease as `status` and `jobs` read it (JSON: no holder token); None where no run ever
    held one (a fleet job, a row of an older version)."""
    if renewed_at is None:
        return None
    return {"held": holder is not None, "renewed_at": iso(renewed_at), "expires_at": iso(expires_at)}


class LeaseHeld(Exception):
    """The job is held by a run that is alive (its lease is live): it is not taken over."""

    def __init__(self, lease: Lease, where: str) -> None:
        self.lease = lease
        ago = ""
        if lease.renewed_at is not None:
            ago = f"; it renewed its lease {max(0, int((utcnow() - lease.renewed_at).total_seconds()))} s ago"
        super().__init__(f"job {lease.job_id} is running ({where}{ago})")


def read_lease(db: Database, job_id: str) -> Lease:
    c = JOBS.c
    stmt = select(c.status, c.lease_holder, c.lease_renewed_at, c.lease_expires_at, c.process).where(
        c.id == job_id
    )
    with db.session(readonly=True) as session:
        row = session.execute(stmt).first()
    if row is None:
        raise JobNotFound(f"no job {job_id!r}")
    return Lease(
        job_id, row.status, row.lease_holder, row.lease_renewed_at, row.lease_expires_at, row.process
    )


def take_lease(db: Database, seen: Lease, holder: str, process: str, lease_s: float) -> bool:
    """Hold the job as `holder`, if the row still says what `seen` said (no one took or renewed it
    meanwhile); True when this call took it. Whether `seen`'s holder may be replaced (released,
    expired, or provably gone) is the caller's decision. Not progress: updated_at stays."""
    c = JOBS.c
    stmt = (
        update(JOBS)
        .where(
            c.id == seen.job_id,
            c.lease_holder.is_not_distinct_from(seen.holder),
            c.lease_renewed_at.is_not_distinct_from(seen.renewed_at),
        )
        .values(process=process, updated_at=c.updated_at, **_renewal(holder, lease_s))
        .returning(c.id)
    )
    with db.session() as session:
        return session.execute(stmt).first() is not None


def renew_lease(db: Database, job_id: str, holder: str, lease_s: float) -> bool:
    """Extend the lease; False when `holder` no longer holds it (another run took the job over)."""
    c = JOBS.c
    stmt = (
        update(JOBS)
        .where(c.id == job_id, c.lease_holder == holder)
        .values(updated_at=c.updated_at, **_renewal(holder, lease_s))
        .returning(c.id)
    )
    with db.session() as session:
        return session.execute(stmt).first() is not None


def release_lease(db: Database, job_id: str, holder: str) -> None:
    """Let go (the run ends); the process stays recorded as history."""
    c = JOBS.c
    stmt = (
        update(JOBS)
        .where(c.id == job_id, c.lease_holder == holder)
        .values(lease_holder=None, lease_expires_at=None, updated_at=c.updated_at)
    )
    with db.session() as session:
        session.execute(stmt)


def end_held(db: Database, job_id: str, holder: str, status: str, error: str) -> bool:
    """End a running job `status` with `error`, only while `holder` holds it: a run that lost its
    lease never cancels or fails the job another run now holds. True when it did."""
    assert status in FINISHED_JOB_STATUSES
    c = JOBS.c
    stmt = (
        update(JOBS)
        .where(c.id == job_id, c.lease_holder == holder, c.status == JobStatus.RUNNING.value)
        .values(
            status=status,
            error=error,
            finished_at=func.coalesce(c.finished_at, now_param()),
            tokens=None,
        )
        .returning(c.id)
    )
    with db.session() as session:
        return session.execute(stmt).first() is not None


def _renewal(holder: str, lease_s: float) -> dict[str, object]:
    now = utcnow()
    return {
        "lease_holder": holder,
        "lease_renewed_at": now,
        "lease_expires_at": now + timedelta(seconds=lease_s),
    }
