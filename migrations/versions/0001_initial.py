"""Initial schema: jobs, sources, units, results.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types as of this revision (a migration must not change when the
# models do later).
JSON_DOCUMENT = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)

JOB_COUNTERS = (
    "sources_total",
    "sources_failed",
    "units_total",
    "units_failed",
    "units_pending",
    "results_total",
    "results_failed",
    "cache_hits",
    "cache_misses",
)
JOB_TOKEN_COUNTERS = ("visual_tokens", "prompt_tokens", "completion_tokens")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", JSON_DOCUMENT, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        *(sa.Column(name, sa.Integer(), server_default="0", nullable=False) for name in JOB_COUNTERS),
        *(
            sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)
            for name in JOB_TOKEN_COUNTERS
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"])
    op.create_index(op.f("ix_jobs_status"), "jobs", ["status"])

    op.create_table(
        "sources",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_sources_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sources")),
        sa.UniqueConstraint("job_id", "uri", name=op.f("uq_sources_job_id_uri")),
    )

    op.create_table(
        "units",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("source_id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("unit_index", sa.Integer(), nullable=False),
        sa.Column("timestamp", sa.Float(), nullable=True),
        sa.Column("width", sa.Integer(), nullable=True),
        sa.Column("height", sa.Integer(), nullable=True),
        sa.Column("image_key", sa.String(length=1024), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("visual_tokens", sa.Integer(), nullable=True),
        sa.Column("cache_key", sa.String(length=1024), nullable=True),
        sa.Column("cache_hit", sa.Boolean(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_units_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["source_id"], ["sources.id"], name=op.f("fk_units_source_id_sources"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_units")),
        sa.UniqueConstraint("source_id", "unit_index", name=op.f("uq_units_source_id_unit_index")),
    )
    op.create_index("ix_units_job_id_status", "units", ["job_id", "status"])

    op.create_table(
        "results",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("unit_id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("prompt_index", sa.Integer(), nullable=False),
        sa.Column("output", JSON_DOCUMENT, nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("visual_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("engine", sa.String(length=64), nullable=False),
        sa.Column("cache_hit", sa.Boolean(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_results_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["unit_id"], ["units.id"], name=op.f("fk_results_unit_id_units"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_results")),
        sa.UniqueConstraint("unit_id", "prompt_index", name=op.f("uq_results_unit_id_prompt_index")),
    )
    op.create_index(op.f("ix_results_job_id"), "results", ["job_id"])


def downgrade() -> None:
    # Children first; dropping a table drops its indexes with it.
    op.drop_table("results")
    op.drop_table("units")
    op.drop_table("sources")
    op.drop_table("jobs")
