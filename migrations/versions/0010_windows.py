"""Answers over several units (issue 34, `--window`): what each result row covers.

results: scope   (`unit`: one page, frame or image; `window`: the units unit_id .. unit_to of
                  its source, asked in one prompt; `source`: a source's summary, `--summarize`,
                  keyed by its first unit, its prompt index one past the job's prompts),
         unit_to (the window's last unit index, inclusive; NULL for a unit's answer),
         turn    (0: the prompt itself; a follow-up turn counts from 1).
A window's answers are keyed by its first unit (unit_id): windows of one source start at
different units. A result is unique on (unit_id, prompt_index, turn) now (was: without turn).

result_rows gains scope, unit_from/unit_to, page_from/page_to (PDFs, 1-based),
time_from/time_to (videos, the first and last frame's time) and turn; its prompt is the turn's
question (a follow-up turn's from the spec's `then`); its other columns are those of 0002.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# The view of 0002, whose columns stay as they were (scripts select them by name).
def _sibling(name: str):  # noqa: ANN202 - a migration module
    """A migration of this folder, read by path as Alembic reads it (the folder is no package)."""
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"_visbatch_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FLEET = _sibling("0002_fleet.py")

_WINDOW_COLUMNS = """,
    r.scope AS scope,
    u.unit_index AS unit_from,
    e.unit_index AS unit_to,
    CASE WHEN s.kind = 'pdf' THEN u.unit_index + 1 END AS page_from,
    CASE WHEN s.kind = 'pdf' THEN e.unit_index + 1 END AS page_to,
    CASE WHEN s.kind = 'video' THEN u."timestamp" END AS time_from,
    CASE WHEN s.kind = 'video' THEN e."timestamp" END AS time_to,
    r.turn AS turn
"""
# The window's last unit (the unit itself for a unit's answer).
_WINDOW_END = """JOIN units AS e
  ON e.source_id = u.source_id AND e.unit_index = COALESCE(r.unit_to, u.unit_index)
"""


# The text a row answers: its prompt (turn 0), the prompt's follow-up turn (the spec's then), or
# for a source's summary (scope `source`) the spec's summarize.
_PROMPT_BY_TURN = {
    "postgresql": "CASE WHEN r.scope = 'source' THEN j.spec ->> 'summarize'"
    " WHEN r.turn = 0 THEN j.spec -> 'prompts' ->> r.prompt_index"
    " ELSE j.spec -> 'then' -> r.prompt_index ->> (r.turn - 1) END",
    "sqlite": "CASE WHEN r.scope = 'source' THEN json_extract(j.spec, '$.summarize')"
    " WHEN r.turn = 0 THEN json_extract(j.spec, '$.prompts[' || r.prompt_index || ']')"
    " ELSE json_extract(j.spec, '$.then[' || r.prompt_index || '][' || (r.turn - 1) || ']') END",
}


def _view_sql(dialect: str) -> str:
    if dialect not in _PROMPT_BY_TURN:
        raise NotImplementedError(f"visbatch supports SQLite and PostgreSQL, not {dialect}")
    columns = _FLEET._VIEW_COLUMNS.format(prompt=_PROMPT_BY_TURN[dialect]).rstrip() + _WINDOW_COLUMNS
    return f"CREATE VIEW result_rows AS SELECT {columns} {_FLEET._VIEW_FROM}{_WINDOW_END}"


def _unique(old: tuple[str, ...], new: tuple[str, ...]) -> None:
    """Swap the results' unique key. SQLite cannot drop a constraint: batch mode rebuilds the
    table (a copy; its indexes, the partial one included, are made again from the models')."""
    with op.batch_alter_table("results") as batch:
        batch.drop_constraint(f"uq_results_{'_'.join(old)}", type_="unique")
        batch.create_unique_constraint(f"uq_results_{'_'.join(new)}", list(new))


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # Columns with server defaults: a plain ADD COLUMN on both dialects, no table rebuild on SQLite.
    op.add_column("results", sa.Column("scope", sa.String(length=16), nullable=False, server_default="unit"))
    op.add_column("results", sa.Column("unit_to", sa.Integer(), nullable=True))
    op.add_column("results", sa.Column("turn", sa.Integer(), nullable=False, server_default="0"))
    op.execute("DROP VIEW IF EXISTS result_rows")  # it reads results: SQLite's rebuild needs it gone
    _unique(("unit_id", "prompt_index"), ("unit_id", "prompt_index", "turn"))
    op.execute(_view_sql(dialect))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS result_rows")
    _unique(("unit_id", "prompt_index", "turn"), ("unit_id", "prompt_index"))
    op.execute(_FLEET._view_sql(dialect))
    op.drop_column("results", "turn")
    op.drop_column("results", "unit_to")
    op.drop_column("results", "scope")
