"""The fleet's safety net for stuck jobs: where a source is read, and when a job was last resumed.

jobs:    resumed_at (when the fleet last resumed this job on its own because it made no progress:
         worker.drivers.stall_watch; a job is not resumed again within the stall threshold).
sources: location (where a fleet worker reads the source: store:<key> for an uploaded file,
         s3://... in place; recorded at submit, so that any worker can send its ingest again).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable columns: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("jobs", sa.Column("resumed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("sources", sa.Column("location", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("sources", "location")
    op.drop_column("jobs", "resumed_at")
