"""Drop-folder claim queries beyond claim/set/find (``storage.repository``): giving a claim back,
and looking claims up by id. Bound parameters only."""

from __future__ import annotations

from sqlalchemy import delete, select

from storage.db import Database
from storage.models import ClaimStatus, DropClaim

DROP_CLAIMS = DropClaim.__table__


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
