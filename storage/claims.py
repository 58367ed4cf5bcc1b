"""Drop-folder claims: one row per S3 object version, won by exactly one watcher
(worker.drivers.dropfolder.watcher).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, update

from storage.db import Database
from storage.models import DROP_CLAIMS, ClaimStatus, utcnow
from storage.sql import NotFound, dialect_insert


@dataclass(frozen=True, slots=True)
class ClaimRow:
    id: int
    bucket: str
    key: str
    etag: str
    job_id: str | None
    status: str
    error: str | None


def claim_object(db: Database, bucket: str, key: str, etag: str) -> int | None:
    """Claim an S3 object version (bucket, key, etag) for processing.

    Returns the new claim's id when THIS caller won it, None when it was claimed before (by any
    watcher, now or earlier). The unique constraint decides in one INSERT .. ON CONFLICT DO
    NOTHING RETURNING: a concurrent second insert waits for the first and then does nothing, so
    there is no check-then-act window (unlike a HEAD-then-PUT lock on S3).
    """
    now = utcnow()
    stmt = (
        dialect_insert(db, DROP_CLAIMS)
        .values(
            bucket=bucket,
            key=key,
            etag=etag,
            status=ClaimStatus.CLAIMED.value,
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_nothing(index_elements=[DROP_CLAIMS.c.bucket, DROP_CLAIMS.c.key, DROP_CLAIMS.c.etag])
        .returning(DROP_CLAIMS.c.id)
    )
    with db.session() as session:
        claim_id = session.execute(stmt).scalar_one_or_none()
    return int(claim_id) if claim_id is not None else None


def set_claim(
    db: Database, claim_id: int, *, status: str, job_id: str | None = None, error: str | None = None
) -> None:
    """Move a claim to ``status``; ``job_id`` and ``error`` are written when given (else kept)."""
    values: dict[str, Any] = {"status": ClaimStatus(status).value, "updated_at": utcnow()}
    if job_id is not None:
        values["job_id"] = job_id
    if error is not None:
        values["error"] = error
    with db.session() as session:
        changed = session.execute(
            update(DROP_CLAIMS)
            .where(DROP_CLAIMS.c.id == claim_id)
            .values(**values)
            .returning(DROP_CLAIMS.c.id)
        )
        if changed.first() is None:
            raise NotFound(f"no drop claim {claim_id}")


def find_claim(db: Database, bucket: str, key: str, etag: str) -> ClaimRow | None:
    """The claim of this object version, if any."""
    stmt = select(
        DROP_CLAIMS.c.id,
        DROP_CLAIMS.c.bucket,
        DROP_CLAIMS.c.key,
        DROP_CLAIMS.c.etag,
        DROP_CLAIMS.c.job_id,
        DROP_CLAIMS.c.status,
        DROP_CLAIMS.c.error,
    ).where(DROP_CLAIMS.c.bucket == bucket, DROP_CLAIMS.c.key == key, DROP_CLAIMS.c.etag == etag)
    with db.session(readonly=True) as session:
        row = session.execute(stmt).one_or_none()
    return ClaimRow(*row) if row is not None else None


def release_claim(db: Database, claim_id: int) -> bool:
    """Delete a claim that is still ``claimed`` (its watcher made no job: the object could not be
    copied, for a reason that may pass), so that a later poll claims the object again.

    Exactly once still holds: only the watcher that won the claim releases it, before any job
    exists; a claim that moved on (submitted, done, failed) is never deleted. True if deleted."""
    with db.session() as session:
        result = session.execute(
            delete(DROP_CLAIMS)
            .where(DROP_CLAIMS.c.id == claim_id, DROP_CLAIMS.c.status == ClaimStatus.CLAIMED.value)
            .returning(DROP_CLAIMS.c.id)
        )
        return result.first() is not None


def claim_keys(db: Database, claim_ids: list[int]) -> dict[int, tuple[str, str]]:
    """``{claim id: (bucket, key)}`` for those of ``claim_ids`` that exist."""
    if not claim_ids:
        return {}
    found: dict[int, tuple[str, str]] = {}
    with db.session(readonly=True) as session:
        for start in range(0, len(claim_ids), 500):  # bounded IN lists
            chunk = claim_ids[start : start + 500]
            rows = session.execute(
                select(DROP_CLAIMS.c.id, DROP_CLAIMS.c.bucket, DROP_CLAIMS.c.key).where(
                    DROP_CLAIMS.c.id.in_(chunk)
                )
            )
            for claim_id, bucket, key in rows:
                found[int(claim_id)] = (bucket, key)
    return found
