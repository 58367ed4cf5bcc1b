"""The database at scale (issue 24): what `status` reads without counting a job's results again,
and the indexes that keep `status` and `visbatch purge` interactive at 10 million results.

jobs:    tokens (the job's token report, counted once by close_job when the job finishes; NULL
         while it runs or after it is reopened: `status` then counts it from the rows).
results: ix_results_job_id_failed, a partial index on job_id WHERE error IS NOT NULL: a job's
         failed answers (status's error list, the view's "failed" filter, docs/sql.md's
         "answers that failed" query) without reading its good ones; it holds only the failed rows.
units:   ix_units_cache_key: which jobs still use a cached entry (`visbatch purge` keeps those).

On a big live PostgreSQL the two CREATE INDEX lock writes to their table while they build (about
a minute for 10M results here; docs/scale.md): an operator can build them first with
CREATE INDEX CONCURRENTLY under these names, and this is then a no-op for them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_DOCUMENT = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    # A nullable column: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("jobs", sa.Column("tokens", JSON_DOCUMENT, nullable=True))
    failed = sa.text("error IS NOT NULL")
    op.create_index(
        "ix_results_job_id_failed",
        "results",
        ["job_id"],
        postgresql_where=failed,
        sqlite_where=failed,
        if_not_exists=True,
    )
    op.create_index("ix_units_cache_key", "units", ["cache_key"], if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_units_cache_key", table_name="units")
    op.drop_index("ix_results_job_id_failed", table_name="results")
    op.drop_column("jobs", "tokens")
