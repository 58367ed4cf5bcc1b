"""Fleet: drop-folder claims, a GIN index on result outputs (PostgreSQL), the result_rows view.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TIMESTAMP = sa.DateTime(timezone=True)

# One row per result, flattened with its job, source, unit and prompt text: what an analyst
# queries with plain SQL. page_number is 1-based for PDFs (NULL otherwise); timestamp is the
# frame time for videos. The prompt text comes from the job spec by index; each dialect has its
# own JSON syntax, so the view is written twice (views are not compared by the drift test).
_VIEW_COLUMNS = """
    r.id AS result_id,
    r.job_id AS job_id,
    s.uri AS source_uri,
    s.kind AS source_kind,
    u.unit_index AS unit_index,
    CASE WHEN s.kind = 'pdf' THEN u.unit_index + 1 END AS page_number,
    u."timestamp" AS "timestamp",
    u.width AS width,
    u.height AS height,
    r.prompt_index AS prompt_index,
    {prompt} AS prompt,
    r.output AS output,
    r.text AS text,
    r.error AS error,
    r.prompt_tokens AS prompt_tokens,
    r.visual_tokens AS visual_tokens,
    r.completion_tokens AS completion_tokens,
    r.finish_reason AS finish_reason,
    r.model AS model,
    r.created_at AS created_at
"""
_VIEW_FROM = """
FROM results AS r
JOIN units AS u ON u.id = r.unit_id
JOIN sources AS s ON s.id = u.source_id
JOIN jobs AS j ON j.id = r.job_id
"""
_PROMPT = {
    "postgresql": "j.spec -> 'prompts' ->> r.prompt_index",
    "sqlite": "json_extract(j.spec, '$.prompts[' || r.prompt_index || ']')",
}


def _view_sql(dialect: str) -> str:
    if dialect not in _PROMPT:
        raise NotImplementedError(f"visbatch supports SQLite and PostgreSQL, not {dialect}")
    return f"CREATE VIEW result_rows AS SELECT {_VIEW_COLUMNS.format(prompt=_PROMPT[dialect])} {_VIEW_FROM}"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name

    op.create_table(
        "drop_claims",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("bucket", sa.String(length=63), nullable=False),
        sa.Column("key", sa.String(length=1024), nullable=False),
        sa.Column("etag", sa.String(length=255), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("updated_at", TIMESTAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_drop_claims_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drop_claims")),
        sa.UniqueConstraint("bucket", "key", "etag", name=op.f("uq_drop_claims_bucket_key_etag")),
    )
    op.create_index(op.f("ix_drop_claims_job_id"), "drop_claims", ["job_id"])

    if dialect == "postgresql":
        # On a big existing results table this locks writes while it builds: an operator can
        # create it first with CREATE INDEX CONCURRENTLY under this name, and this is then a no-op.
        op.create_index(
            "ix_results_output_gin",
            "results",
            ["output"],
            postgresql_using="gin",
            postgresql_ops={"output": "jsonb_path_ops"},
            if_not_exists=True,
        )

    op.execute(_view_sql(dialect))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS result_rows")
    if dialect == "postgresql":
        op.drop_index("ix_results_output_gin", table_name="results")
    op.drop_index(op.f("ix_drop_claims_job_id"), table_name="drop_claims")
    op.drop_table("drop_claims")
