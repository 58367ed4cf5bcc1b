"""What a running job waits for (issue 32): `visbatch status` says `waiting: the disk is full
(/data/store); trying again` from the first retry, instead of nothing until the stall watch.

jobs: waiting (the cause of the last retry of the job's work: a full disk, S3 away, ...),
      waiting_at (when it was noted; a note older than a retry's longest wait is stale).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable columns: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("jobs", sa.Column("waiting", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("waiting_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "waiting_at")
    op.drop_column("jobs", "waiting")
