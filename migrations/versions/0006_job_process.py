"""Which process runs a job in one process (embedded), so that a job whose process is gone is
shown `interrupted`, not `running` (worker.drivers.job_activity).

jobs: process ("HOST:PID:START": the host name, the pid and the process's start time, recorded
      when `visbatch run`, `resume` or the Python API starts the work; kept as history after).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A nullable column: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("jobs", sa.Column("process", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "process")
