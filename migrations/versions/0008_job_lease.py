"""Liveness by lease (issue 32): a job run in one process is `interrupted` when its run stopped
renewing its lease, not when a pid is missing from this host's /proc (in a container the run is
pid 1 of its own PID namespace, under a host name that other containers share).

jobs: lease_holder (a random token of the run that holds the job now; NULL once it let go),
      lease_renewed_at (when that run last renewed it: every few seconds while it runs),
      lease_expires_at (until when the renewal holds: the holder's own lease length decides, so
      a reader needs no setting to tell a live run from a gone one).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable columns: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("jobs", sa.Column("lease_holder", sa.String(32), nullable=True))
    op.add_column("jobs", sa.Column("lease_renewed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "lease_expires_at")
    op.drop_column("jobs", "lease_renewed_at")
    op.drop_column("jobs", "lease_holder")
