"""Q6. Results into PostgreSQL: `repository.upsert_results` against row-by-row ORM inserts.

Real PostgreSQL (VISBATCH_BENCH_POSTGRES_URL, default the local server's `test` database), in a
schema of its own, migrated to head and dropped afterwards. One job with N units; every arm
writes results for all of them, N x 4 prompts, into fresh (unit, prompt) keys.

  upsert_results, k per call   what the pipeline does: one bulk INSERT .. ON CONFLICT DO UPDATE per
                               call (the embedded run calls it per generate batch, <= 16 rows; a
                               fleet flush, up to 64 units x prompts; an import, thousands);
  upsert again (updates)       the same keys re-written (a retried batch): the conflict path;
  ORM, commit per k            session.add(Result(...)) per row, one commit every k rows;
  ORM, commit per row          session.add + commit for every row (on fewer rows: it is slow).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, registry

from bench.common import Check, arguments, bars, interleaved, median, rounded, write_result
from storage import repository as repo
from storage.db import Database
from storage.models import RESULTS

POSTGRES_URL = os.environ.get(
    "VISBATCH_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
PROMPTS = 4
TARGET_CALL = 1000
ORM_BATCH = f"ORM, commit every {TARGET_CALL}"
ORM_ROW = "ORM, commit every row"


def bulk_name(size: int) -> str:
    return f"bulk upsert, {size}/call"


@contextmanager
def scratch_schema() -> Iterator[str]:
    """A URL whose connections see a fresh schema only; the schema is dropped afterwards."""
    base = make_url(POSTGRES_URL)
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False
        )
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def make_units(db: Database, units: int) -> tuple[str, list[int]]:
    job = repo.create_job(db, {"prompts": ["p"] * PROMPTS}, status="running")
    source = repo.add_source(db, job, "bench.pdf")
    ids: list[int] = []
    for start in range(0, units, 1000):
        rows = [
            repo.UnitRow(index=i, width=911, height=1288, image_key=f"images/{i:08d}.png", visual_tokens=1196)
            for i in range(start, min(units, start + 1000))
        ]
        ids += repo.add_units(db, job, source, rows)
    return job, ids


def result_rows(unit_ids: list[int], first_prompt: int) -> list[repo.ResultRow]:
    return [
        repo.ResultRow(
            unit_id=u,
            prompt_index=first_prompt + p,
            output={"total": "1234.50", "vendor": "ACME"},
            text='{"total": "1234.50", "vendor": "ACME"}',
            error=None,
            prompt_tokens=24,
            visual_tokens=1196,
            completion_tokens=18,
            finish_reason="stop",
            model="bench",
            engine="transformers",
            cache_hit=True,
            latency_ms=812.5,
        )
        for u in unit_ids
        for p in range(PROMPTS)
    ]


class Result:
    """The baseline's ORM class: visbatch itself has none (it writes Core statements), so it is
    mapped here, onto the same table."""

    def __init__(self, **values: object) -> None:
        for name, value in values.items():
            setattr(self, name, value)


registry().map_imperatively(Result, RESULTS)


def orm_insert(db: Database, job: str, rows: list[repo.ResultRow], commit_every: int) -> None:
    with Session(db.engine) as session:
        for n, row in enumerate(rows, 1):
            session.add(Result(job_id=job, **{f: getattr(row, f) for f in row.__slots__}))
            if n % commit_every == 0:
                session.commit()
        session.commit()


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=3)
    units = 1000 if args.quick else 5000
    per_row_units = 100 if args.quick else 500
    with scratch_schema() as url:
        db = Database(url)
        db.upgrade()
        job, unit_ids = make_units(db, units)
        counter = iter(range(0, 10**6, PROMPTS))  # a fresh block of prompt indexes per arm run
        written: dict[str, int] = {}

        def upsert(size: int):
            def go(_rep: int) -> None:
                rows = result_rows(unit_ids, next(counter))
                for i in range(0, len(rows), size):
                    repo.upsert_results(db, job, rows[i : i + size])
                written[bulk_name(size)] = len(rows)

            return go

        def orm(commit_every: int, subset: list[int], name: str):
            def go(_rep: int) -> None:
                rows = result_rows(subset, next(counter))
                orm_insert(db, job, rows, commit_every)
                written[name] = len(rows)

            return go

        arms = {bulk_name(k): upsert(k) for k in (16, 64, TARGET_CALL)}
        arms[ORM_BATCH] = orm(TARGET_CALL, unit_ids, ORM_BATCH)
        arms[ORM_ROW] = orm(1, unit_ids[:per_row_units], ORM_ROW)
        times = interleaved(arms, args.reps)

        # Conflict path: re-upsert keys that exist (prepared untimed, then timed alone per rep).
        update_s = []
        for _ in range(args.reps):
            rows = result_rows(unit_ids, next(counter))
            repo.upsert_results(db, job, rows)
            changed = [
                r.__class__(**{**{f: getattr(r, f) for f in r.__slots__}, "latency_ms": 1.0}) for r in rows
            ]
            seconds = interleaved({"update": lambda _r, rows=changed: _upsert_all(db, job, rows)}, 1)
            update_s.append(seconds["update"][0])
        db.dispose()

    rate = {name: written[name] / median(s) for name, s in times.items()}
    rate[f"bulk upsert, {TARGET_CALL}/call, keys exist"] = len(unit_ids) * PROMPTS / median(update_s)
    bulk = rate[bulk_name(TARGET_CALL)]
    figures = {
        "units": units,
        "results_per_arm": written,
        "timings": times.rounded(),
        "update_seconds": [round(x, 3) for x in update_s],
        "results_per_s": {k: round(v) for k, v in rate.items()},
        "bulk_vs_orm_batched": rounded(bulk / rate[ORM_BATCH]),
        "bulk_vs_orm_per_row": rounded(bulk / rate[ORM_ROW]),
    }
    checks = [
        Check(f"upsert_results, {TARGET_CALL} results per call", round(bulk), ">=", 10_000, unit=" results/s")
    ]
    small = {k: round(rate[bulk_name(k)]) for k in (16, 64)}
    notes = [
        f"smaller calls pay a transaction each: {small[16]:,} results/s at 16 per call (an embedded "
        f"generate batch), {small[64]:,} at 64 (a fleet flush); the ORM: {round(rate[ORM_BATCH]):,} "
        f"results/s committing every {TARGET_CALL}, {round(rate[ORM_ROW]):,} committing every row"
    ]
    labels = list(rate)
    write_result(
        "results_db",
        quick=args.quick,
        question="Results into PostgreSQL",
        baseline="SQLAlchemy ORM: session.add per row, commit per row and commit per 1000 rows",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            labels, [round(rate[k]) for k in labels], "results/s", "Q6 results into PostgreSQL", log=True
        ),
        notes=notes,
    )


def _upsert_all(db: Database, job: str, rows: list[repo.ResultRow]) -> None:
    for i in range(0, len(rows), TARGET_CALL):
        repo.upsert_results(db, job, rows[i : i + TARGET_CALL])


if __name__ == "__main__":
    main()
