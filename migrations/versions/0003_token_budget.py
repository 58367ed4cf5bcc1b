"""Visual-token budget: per-unit resize bounds, full token count, skipped frames; pruned tokens.

units:   min_pixels, max_pixels (the bounds the unit is encoded with; NULL = the model's own),
         full_tokens (its tokens at the model's own bounds), skip_reason and duplicate_of (a video
         frame skipped as a near-duplicate of an earlier kept frame: status 'skipped').
results: pruned_tokens (visual tokens left out of the LM input by pruning).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-13
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNIT_COLUMNS = (
    ("min_pixels", sa.Integer()),
    ("max_pixels", sa.Integer()),
    ("full_tokens", sa.Integer()),
    ("skip_reason", sa.Text()),
    ("duplicate_of", sa.Integer()),
)


def upgrade() -> None:
    # Plain ADD COLUMN on both dialects: nullable columns, or NOT NULL with a server default,
    # need no table rebuild (SQLite) and no rewrite of existing rows (PostgreSQL 11+).
    for name, type_ in _UNIT_COLUMNS:
        op.add_column("units", sa.Column(name, type_, nullable=True))
    op.add_column(
        "results", sa.Column("pruned_tokens", sa.Integer(), nullable=False, server_default=sa.text("0"))
    )


def downgrade() -> None:
    op.drop_column("results", "pruned_tokens")
    for name, _ in reversed(_UNIT_COLUMNS):
        op.drop_column("units", name)
