"""Streaming execution: stage busy times on jobs, an ingest cursor on sources, merged tokens.

jobs:    started_at, first_result_at (when work began and the first result was stored),
         ingest_seconds, encode_seconds, generate_seconds (busy time of each stage, summed over
         every process that worked on the job).
sources: next_unit (units before it are stored: a fleet ingest task covers a range of units and
         hands the rest on, so no task outlives the broker's redelivery timeout).
results: merged_tokens (visual tokens merged into their neighbours before the LM).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
_JOB_TIMES = ("started_at", "first_result_at")
_JOB_SECONDS = ("ingest_seconds", "encode_seconds", "generate_seconds")


def upgrade() -> None:
    # Nullable columns, or NOT NULL with a server default: plain ADD COLUMN on both dialects.
    for name in _JOB_TIMES:
        op.add_column("jobs", sa.Column(name, TIMESTAMP, nullable=True))
    for name in _JOB_SECONDS:
        op.add_column("jobs", sa.Column(name, sa.Float(), nullable=False, server_default=sa.text("0")))
    op.add_column(
        "sources", sa.Column("next_unit", sa.Integer(), nullable=False, server_default=sa.text("0"))
    )
    op.add_column(
        "results", sa.Column("merged_tokens", sa.Integer(), nullable=False, server_default=sa.text("0"))
    )


def downgrade() -> None:
    op.drop_column("results", "merged_tokens")
    op.drop_column("sources", "next_unit")
    for name in reversed(_JOB_SECONDS + _JOB_TIMES):
        op.drop_column("jobs", name)
