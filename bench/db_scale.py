"""Issue 24: the database at scale. One job of N result rows (default 10 million: 2.5M pages x 4
prompts) in PostgreSQL, and what a user's commands cost on it.

A database of its own on the local server (``visbatch_scale``, made from
VISBATCH_BENCH_POSTGRES_URL's server; dropped at the end unless --keep), migrated with the project's
migrations, then filled server-side: ``INSERT .. SELECT`` over ``generate_series`` (a bulk insert
that never leaves PostgreSQL: on this 2-core machine Python cannot format 10M rows for COPY as fast
as the server makes them). The shapes are those of a real document job:

  job A      N/4 pages of PDFs of 1 to 43 pages (22 on average), 4 prompts, JSON answers
             ({"total", "vendor", "has_table", "date"}); 1 answer in 1000 failed schema validation
             (text kept, error set); page images and cache keys content-addressed by (uri, page);
  job B      a second run over the first 10% of A's documents (N/10 rows), 2% of its answers
             differ: what `visbatch compare` is for (a cheaper run checked on a sample);
  fillers    300 small finished jobs spread over 90 days (what `visbatch jobs` and
             `visbatch purge --older-than` see beside the big ones).

Then each user command runs as a user runs it: the `visbatch` executable as a process (start-up
included) with VISBATCH_DATABASE_URL, timed wall-clock, peak RSS read from wait4(); and each
PostgreSQL query of docs/sql.md, with EXPLAIN (ANALYZE, BUFFERS) printed for the slow ones.
The load average is recorded beside every timing (the machine is shared).

  python -m bench db_scale                 # 10M rows (about 45 min on this shared 2-core machine)
  python -m bench --quick db_scale         # 400,000 rows
  python -m bench.db_scale --rows 1000000  # any size
  python -m bench.db_scale --keep          # keep the database (then --reuse times it again)
  python -m bench.db_scale --tree DIR      # time the commands of another checkout (e.g. the code
                                           # before the fixes: git archive COMMIT | tar -x -C DIR)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

from bench.common import ROOT, Check, bars, write_result

BASE_URL = os.environ.get("VISBATCH_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DATABASE = "visbatch_scale"
PROMPTS = [
    "Extract the invoice fields.",
    "Does the page hold a table?",
    "Who is the vendor?",
    "What is the date?",
]
SLOW_S = 0.5  # queries slower than this get their plan printed
SOURCES_PER_BATCH = 10_000
FILLER_JOBS = 300


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# --- the database ---------------------------------------------------------------------------------


def admin_engine() -> Engine:
    return create_engine(BASE_URL, isolation_level="AUTOCOMMIT")


def scale_url(name: str = DATABASE) -> str:
    return make_url(BASE_URL).set(database=name).render_as_string(hide_password=False)


def create_database(name: str) -> None:
    admin = admin_engine()
    with admin.connect() as conn:
        # Identifiers cannot be bound; the name is this module's constant (or --database, checked).
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()


def drop_database(name: str) -> None:
    admin = admin_engine()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


# Documents of 1, 8, 15, ... 43 pages (22 on average): page count of document g.
PAGES_SQL = "1 + (g * 7) % 49"


def page_counts(pages: int) -> list[int]:
    counts: list[int] = []
    total, g = 0, 0
    while total < pages:
        n = min(1 + (g * 7) % 49, pages - total)
        counts.append(n)
        total += n
        g += 1
    return counts


def _spec() -> dict[str, Any]:
    return {
        "prompts": PROMPTS,
        "model": "Qwen/Qwen2-VL-7B-Instruct",
        "json_schema": {"type": "object", "properties": {"total": {"type": "string"}}},
    }


def insert_job(conn: Any, job_id: str, created: datetime, status: str = "running") -> None:
    conn.execute(
        text(
            "INSERT INTO jobs (id, created_at, updated_at, started_at, status, spec) "
            "VALUES (:id, :t, :t, :t, :status, CAST(:spec AS jsonb))"
        ),
        {"id": job_id, "t": created, "status": status, "spec": json.dumps(_spec())},
    )


_SOURCES = (
    """
INSERT INTO sources (job_id, uri, sha256, kind, bytes, status, created_at, next_unit)
SELECT :job, 's3://bench-docs/inbox/doc-' || lpad(g::text, 8, '0') || '.pdf',
       md5(g::text) || md5('doc' || g::text), 'pdf', 150000 + (g % 1000) * 1000, 'ingested', :t,
       """
    + PAGES_SQL
    + """
FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint) - 1) AS g
"""
)

# Pages (units) of the job's sources with ids in [lo, hi]; images and cache keys are
# content-addressed by (uri, page): two jobs over the same documents share them.
_UNITS = """
INSERT INTO units (source_id, job_id, unit_index, width, height, image_key, visual_tokens,
                   full_tokens, cache_key, cache_hit, status)
SELECT s.id, s.job_id, i, 911, 1288, 'images/' || substr(h, 1, 2) || '/' || h || '.png', 1196, 1196,
       'bench-' || h, (s.id + i) % 10 = 0, 'done'
FROM sources AS s
CROSS JOIN LATERAL generate_series(0, s.next_unit - 1) AS i
CROSS JOIN LATERAL (SELECT md5(s.uri || ':' || i) AS h) AS x
WHERE s.job_id = :job AND s.id BETWEEN :lo AND :hi
"""

# 4 answers per page; v is a stable pseudo-random number of (uri, page, prompt), so that the
# second job agrees with the first except where :differ picks it.
_RESULTS = """
INSERT INTO results (unit_id, job_id, prompt_index, output, text, error, prompt_tokens, visual_tokens,
                     completion_tokens, pruned_tokens, merged_tokens, finish_reason, model, engine,
                     cache_hit, latency_ms, created_at, updated_at)
SELECT u.id, u.job_id, p,
       CASE WHEN v % 1000 = 7 THEN NULL ELSE o END,
       o::text,
       CASE WHEN v % 1000 = 7 THEN 'output is not valid for the schema: ''total'' is not a string' END,
       24 + p, 1196, 18 + v % 40, 0, 0, 'stop', 'Qwen/Qwen2-VL-7B-Instruct', 'vllm', u.cache_hit,
       400 + v % 800, :t, :t
FROM units AS u
JOIN sources AS s ON s.id = u.source_id
CROSS JOIN generate_series(0, 3) AS p
CROSS JOIN LATERAL (
  SELECT abs(('x' || substr(md5(s.uri || ':' || u.unit_index || ':' || p), 1, 8))::bit(32)::int) AS v
) AS r
CROSS JOIN LATERAL (
  SELECT jsonb_build_object(
    'total', ((v % 500000) / 100.0)::numeric(12, 2)::text,
    'vendor', 'Vendor ' || CASE WHEN v % 50 < :differ THEN (v % 991) + 7 ELSE v % 997 END,
    'has_table', v % 5 = 0,
    'date', '2026-' || lpad((1 + v % 12)::text, 2, '0') || '-' || lpad((1 + v % 28)::text, 2, '0')
  ) AS o
) AS j
WHERE u.job_id = :job AND u.source_id BETWEEN :lo AND :hi
"""


@dataclass
class Loaded:
    job_a: str
    job_b: str
    rows_a: int
    rows_b: int
    pages_a: int
    sources_a: int
    seconds: dict[str, float] = field(default_factory=dict)


def _fill_job(engine: Engine, job_id: str, counts: Sequence[int], created: datetime, differ: int) -> None:
    """Sources, units and results of one job, SOURCES_PER_BATCH documents per transaction."""
    for start in range(0, len(counts), SOURCES_PER_BATCH):
        end = min(len(counts), start + SOURCES_PER_BATCH)
        with engine.begin() as conn:
            ids = conn.execute(
                text(_SOURCES + " RETURNING id"), {"job": job_id, "t": created, "lo": start, "hi": end}
            ).scalars()
            ids = sorted(ids)
            lo, hi = ids[0], ids[-1]
            if end == len(counts) and counts[-1] != 1 + ((end - 1) * 7) % 49:
                # The last document is cut to make the page total exact.
                conn.execute(
                    text("UPDATE sources SET next_unit = :n WHERE id = :id"), {"n": counts[-1], "id": hi}
                )
            conn.execute(text(_UNITS), {"job": job_id, "lo": lo, "hi": hi})
            conn.execute(text(_RESULTS), {"job": job_id, "lo": lo, "hi": hi, "t": created, "differ": differ})
        done = sum(counts[:end]) * len(PROMPTS)
        print(f"  {job_id[:8]}: {done:,} results ({loadavg()})", flush=True)


def load(url: str, rows: int) -> Loaded:
    from storage import repository as repo
    from storage.db import Database

    pages = rows // len(PROMPTS)
    counts = page_counts(pages)
    sample = counts[: max(1, len(counts) // 10)]
    now = datetime.now(UTC)
    job_a, job_b = "a" * 8 + os.urandom(12).hex(), "b" * 8 + os.urandom(12).hex()
    engine = create_engine(url)
    seconds: dict[str, float] = {}
    with engine.begin() as conn:
        insert_job(conn, job_a, now - timedelta(days=1))
        insert_job(conn, job_b, now - timedelta(days=40))
    t0 = time.perf_counter()
    _fill_job(engine, job_a, counts, now - timedelta(days=1), differ=0)
    seconds["load_a"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _fill_job(engine, job_b, sample, now - timedelta(days=40), differ=1)
    seconds["load_b"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _fillers(engine, now)
    seconds["load_fillers"] = time.perf_counter() - t0
    engine.dispose()
    # What autovacuum does on its own in time: statistics and the visibility map (index-only scans).
    t0 = time.perf_counter()
    vacuum(url)
    seconds["vacuum_analyze"] = time.perf_counter() - t0
    db = Database(url)
    for job in (job_b, job_a):  # the fan-in's close: recounts every counter from the rows
        t0 = time.perf_counter()
        repo.close_job(db, job)
        seconds[f"close_job_{'a' if job == job_a else 'b'}"] = time.perf_counter() - t0
    db.dispose()
    return Loaded(job_a, job_b, pages * len(PROMPTS), sum(sample) * len(PROMPTS), pages, len(counts), seconds)


def vacuum(url: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()


def _fillers(engine: Engine, now: datetime) -> None:
    """Small finished jobs over the last 90 days: 1 document of 2 pages, 8 answers each."""
    for n in range(FILLER_JOBS):
        job = f"f{n:07d}" + os.urandom(12).hex()
        created = now - timedelta(days=90 * n / FILLER_JOBS, minutes=5)
        with engine.begin() as conn:
            insert_job(conn, job, created, status="succeeded")
            conn.execute(
                text(
                    "INSERT INTO sources (job_id, uri, kind, status, created_at, next_unit) "
                    "VALUES (:job, :uri, 'pdf', 'ingested', :t, 2)"
                ),
                {"job": job, "uri": f"s3://bench-docs/small/{n}.pdf", "t": created},
            )
            sid = conn.execute(text("SELECT id FROM sources WHERE job_id = :job"), {"job": job}).scalar_one()
            conn.execute(text(_UNITS), {"job": job, "lo": sid, "hi": sid})
            conn.execute(text(_RESULTS), {"job": job, "lo": sid, "hi": sid, "t": created, "differ": 0})
            conn.execute(
                text(
                    "UPDATE jobs SET sources_total = 1, units_total = 2, results_total = 8, "
                    "finished_at = :t WHERE id = :job"
                ),
                {"job": job, "t": created + timedelta(minutes=3)},
            )


# --- the commands, as a user runs them -------------------------------------------------------------


@dataclass
class Run:
    what: str
    seconds: float
    max_rss_mb: float
    load1: float
    rc: int
    note: str = ""


class Cli:
    """`visbatch ARGS` as a process: this checkout's executable, or another checkout's code."""

    def __init__(self, url: str, home: Path, tree: Path | None) -> None:
        self.env = {**os.environ, "VISBATCH_DATABASE_URL": url, "VISBATCH_HOME": str(home)}
        self.env.pop("VISBATCH_DEBUG", None)
        if tree is not None:
            self.env["PYTHONPATH"] = str(tree)
            code = "from worker.cli.main import app; app(prog_name='visbatch')"
            self.argv = [sys.executable, "-c", code]
            self.cwd = tree
        else:
            self.argv = [str(Path(sys.executable).with_name("visbatch"))]
            self.cwd = ROOT

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen([*self.argv, *args], env=self.env, cwd=self.cwd, **kwargs)

    def run(self, what: str, args: Sequence[str], reps: int = 1) -> Run:
        """The best of `reps` runs (wall clock), with the peak RSS of that run."""
        best: Run | None = None
        for _ in range(reps):
            load = load1()
            started = time.perf_counter()
            proc = self.popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            stderr = b""
            _, status, usage = os.wait4(proc.pid, 0)
            seconds = time.perf_counter() - started
            if proc.stderr is not None:
                stderr = proc.stderr.read()
                proc.stderr.close()
            proc.returncode = os.waitstatus_to_exitcode(status)
            run = Run(what, seconds, usage.ru_maxrss / 1024, load, proc.returncode)
            if proc.returncode != 0:
                run.note = stderr.decode(errors="replace")[-300:]
            if best is None or run.seconds < best.seconds:
                best = run
        assert best is not None
        print(f"  {best.what}: {best.seconds:.2f} s, peak RSS {best.max_rss_mb:.0f} MB, load {best.load1}"
              + (f" rc={best.rc} {best.note}" if best.rc else ""), flush=True)  # fmt: skip
        return best


def time_view(cli: Cli, job: str, url: str) -> list[Run]:
    """`visbatch view JOB`: from start to the first page served, then the pages a reviewer opens."""
    load = load1()
    started = time.perf_counter()
    proc = cli.popen(["view", job, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs: list[Run] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"http://\S+/", line)
        if not match:
            raise RuntimeError(f"view did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
        base = match.group(0)
        engine = create_engine(url)
        with engine.connect() as conn:
            full = conn.execute(text("SELECT id FROM jobs WHERE id LIKE :p"), {"p": job + "%"}).scalar_one()
            n_sources = conn.execute(
                text("SELECT count(*) FROM sources WHERE job_id = :j"), {"j": full}
            ).scalar_one()
            biggest = conn.execute(
                text("SELECT id FROM sources WHERE job_id = :j ORDER BY next_unit DESC, id LIMIT 1"),
                {"j": full},
            ).scalar_one()
        engine.dispose()
        last_index = max(1, -(-n_sources // 200))
        pages = [
            ("view: start + index.html", "index.html"),
            ("view: index.html again", "index.html"),
            (f"view: index-{last_index}.html (last sources page)", f"index-{last_index}.html"),
            ("view: a source's pages (all)", f"source-{biggest}-all-1.html"),
            ("view: a source's failed answers", f"source-{biggest}-failed-1.html"),
        ]
        first = True
        for what, path in pages:
            t0 = started if first else time.perf_counter()
            load = load if first else load1()
            with urllib.request.urlopen(base + path, timeout=600) as response:
                response.read()
                status = response.status
            seconds = time.perf_counter() - t0
            runs.append(Run(what, seconds, 0.0, load, 0 if status == 200 else status))
            print(f"  {what}: {seconds:.2f} s, load {load}", flush=True)
            first = False
    finally:
        usage = _stop(proc)
        for run in runs:
            run.max_rss_mb = usage.ru_maxrss / 1024 if usage is not None else 0.0
    return runs


def _stop(proc: subprocess.Popen) -> Any:
    """Ctrl-C, as a user stops `view`; SIGTERM if it has not ended 10 s later. Its rusage."""
    proc.send_signal(signal.SIGINT)
    for _ in range(100):
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return usage
        time.sleep(0.1)
    proc.terminate()
    return os.wait4(proc.pid, 0)[2]


# --- the documented queries ------------------------------------------------------------------------


def documented_queries() -> list[str]:
    """docs/sql.md's PostgreSQL statements (as tests/test_docs_commands.py reads them)."""
    queries: list[str] = []
    body = (ROOT / "docs" / "sql.md").read_text()
    for block in re.findall(r"```sql\n(.*?)```", body, flags=re.S):
        current = None
        for statement in block.split(";"):
            for line in statement.strip().splitlines():
                label = re.match(r"^-- (\w+):", line)
                if label:
                    current = label.group(1)
            code = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
            if code and current == "PostgreSQL":
                queries.append(code)
    return queries


@dataclass
class Query:
    sql: str
    seconds: float
    rows: int
    load1: float
    plan: list[str] = field(default_factory=list)


def time_queries(url: str, job: str, queries: Sequence[str]) -> list[Query]:
    engine = create_engine(url)
    out: list[Query] = []
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        for n, sql in enumerate(queries):
            # The docs' queries carry '...' where a job id goes, and plain % and : (no parameters).
            sql = sql.replace("'...'", f"'{job}'")
            load = load1()
            t0 = time.perf_counter()
            # All rows to the client, as psql fetches them, but through a server-side cursor: a
            # query of millions of rows must not hold them all in this process.
            named = raw.driver_connection.cursor(name=f"docs_query_{n}")
            named.execute(sql)
            rows = 0
            while batch := named.fetchmany(10_000):
                rows += len(batch)
            named.close()
            seconds = time.perf_counter() - t0
            query = Query(sql, seconds, rows, load)
            if seconds > SLOW_S:
                cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql)
                query.plan = [row[0] for row in cursor.fetchall()]
            raw.rollback()
            out.append(query)
            first = " ".join(sql.split())[:90]
            print(f"  query {first}...: {seconds:.2f} s, {rows:,} rows, load {load}", flush=True)
            for line in query.plan:
                print(f"      {line}")
    finally:
        raw.close()
        engine.dispose()
    return out


def in_process(url: str, job: str, tree: Path | None) -> dict[str, float]:
    """The database's share of `status` and `jobs`: their storage calls timed in a process that has
    already imported everything (best of 3), in the checkout timed."""
    code = (
        "import sys, time, json\n"
        "from storage import repository as repo\n"
        "from storage.db import Database\n"
        "db = Database(sys.argv[1])\n"
        "out = {}\n"
        "for name, fn in (('job_summary', lambda: repo.job_summary(db, sys.argv[2])),\n"
        "                 ('list_jobs', lambda: repo.list_jobs(db))):\n"
        "    best = None\n"
        "    for _ in range(3):\n"
        "        t0 = time.perf_counter(); fn(); t = time.perf_counter() - t0\n"
        "        best = t if best is None else min(best, t)\n"
        "    out[name] = round(best, 3)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    done = subprocess.run(
        [sys.executable, "-c", code, url, job], env=env, cwd=tree or ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"  in-process timing failed: {done.stderr[-500:]}", flush=True)
        return {}
    figures = json.loads(done.stdout)
    figures["load1"] = load1()
    print(f"  in process (database share): {figures}", flush=True)
    return figures


def explain_status(url: str, job: str) -> dict[str, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the statements behind `visbatch status` that read results."""
    from sqlalchemy import func, select

    from storage.db import Database
    from storage.jobs import _errors_select
    from storage.models import RESULTS

    db = Database(url)
    plans: dict[str, list[str]] = {}
    statements = {
        "status: result totals (live count)": select(
            func.count(), func.count(RESULTS.c.error), func.sum(RESULTS.c.prompt_tokens)
        ).where(RESULTS.c.job_id == job),
        "status: failed answers (first 1001)": _errors_select(job)[2].limit(1001),
    }
    with db.engine.connect() as conn:
        for name, stmt in statements.items():
            compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
            rows = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, BUFFERS) {compiled}").all()
            plans[name] = [row[0] for row in rows]
            print(f"  plan of {name}:")
            for line in plans[name]:
                print(f"      {line}")
    db.dispose()
    return plans


# --- main ------------------------------------------------------------------------------------------


def _size(url: str) -> dict[str, str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        sizes = {
            name: conn.execute(text("SELECT pg_size_pretty(pg_total_relation_size(CAST(:t AS regclass)))"),
                               {"t": name}).scalar_one()
            for name in ("results", "units", "sources", "jobs")
        }  # fmt: skip
        sizes["database"] = conn.execute(
            text("SELECT pg_size_pretty(pg_database_size(current_database()))")
        ).scalar_one()
    engine.dispose()
    return sizes


def existing_jobs(url: str) -> tuple[str, str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        a = conn.execute(text("SELECT id FROM jobs WHERE id LIKE 'aaaaaaaa%'")).scalar_one()
        b = conn.execute(text("SELECT id FROM jobs WHERE id LIKE 'bbbbbbbb%'")).scalar_one()
    engine.dispose()
    return a, b


def count_rows(url: str, job: str) -> int:
    engine = create_engine(url)
    with engine.connect() as conn:
        n = conn.execute(text("SELECT results_total FROM jobs WHERE id = :j"), {"j": job}).scalar_one()
    engine.dispose()
    return int(n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000, help="result rows of the big job")
    parser.add_argument("--quick", action="store_true", help="--rows 400000")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--reuse", action="store_true", help="time the kept database again (no load)")
    parser.add_argument("--revision", default="head", help="migrate the new database to this revision")
    parser.add_argument("--upgrade", action="store_true", help="--reuse: migrate to head first (timed)")
    parser.add_argument("--tree", type=Path, default=None, help="time the commands of this checkout")
    parser.add_argument("--database", default=DATABASE, help="database name (on the bench server)")
    parser.add_argument(
        "--skip", default="", help="comma-separated: status,export,view,compare,queries,purge"
    )
    parser.add_argument("--label", default="", help="a name for this run in the result file")
    args = parser.parse_args()
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,40}", args.database):
        parser.error("--database: lower-case letters, digits and _ only")
    rows = 400_000 if args.quick else args.rows
    skip = set(filter(None, args.skip.split(",")))
    url = scale_url(args.database)
    print(f"db_scale: {rows:,} rows in database {args.database} (load {loadavg()})", flush=True)

    from storage.db import Database

    figures: dict[str, Any] = {"rows": rows, "load_before": loadavg(), "tree": str(args.tree or ROOT)}
    if args.reuse:
        job_a, job_b = existing_jobs(url)
        if args.upgrade:
            db = Database(url)
            t0 = time.perf_counter()
            db.upgrade()
            figures["upgrade_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"  migrated to head: {figures['upgrade_seconds']} s", flush=True)
            from storage import repository as repo

            for job in (job_b, job_a):  # jobs closed by this code (close_job is idempotent)
                t0 = time.perf_counter()
                repo.close_job(db, job)
                print(f"  close_job {job[:8]}: {time.perf_counter() - t0:.1f} s", flush=True)
            db.dispose()
        rows_a, rows_b = count_rows(url, job_a), count_rows(url, job_b)
    else:
        create_database(args.database)
        db = Database(url)
        t0 = time.perf_counter()
        db.upgrade(args.revision)
        db.dispose()
        print(f"  migrated to {args.revision}: {time.perf_counter() - t0:.1f} s", flush=True)
        loaded = load(url, rows)
        job_a, job_b, rows_a, rows_b = loaded.job_a, loaded.job_b, loaded.rows_a, loaded.rows_b
        figures["load_seconds"] = {k: round(v, 1) for k, v in loaded.seconds.items()}
        figures["pages"] = loaded.pages_a
        figures["sources"] = loaded.sources_a
        print(f"  loaded: {figures['load_seconds']} ({loadavg()})", flush=True)
    figures["sizes"] = _size(url)
    figures["jobs"] = {"a": job_a, "b": job_b, "rows_a": rows_a, "rows_b": rows_b}
    print(f"  sizes: {figures['sizes']}", flush=True)

    runs: list[Run] = []
    queries: list[Query] = []
    with tempfile.TemporaryDirectory(prefix="db-scale-") as tmp:
        home = Path(tmp) / "home"
        cli = Cli(url, home, args.tree)
        runs.append(cli.run("visbatch --help (start-up alone)", ["--help"], reps=3))
        if "status" not in skip:
            runs.append(cli.run(f"visbatch status A ({rows_a:,} rows)", ["status", job_a[:12]], reps=3))
            runs.append(cli.run(f"visbatch status B ({rows_b:,} rows)", ["status", job_b[:12]], reps=3))
            runs.append(cli.run("visbatch status A --json", ["status", job_a[:12], "--json"], reps=3))
            runs.append(cli.run("visbatch jobs", ["jobs"], reps=3))
            runs.append(cli.run("visbatch jobs --limit 200", ["jobs", "--limit", "200"], reps=3))
            figures["status_plans"] = explain_status(url, job_a)
            figures["in_process"] = in_process(url, job_a, args.tree)

        def export(name: str, job: str, n: int) -> None:
            out = Path(tmp) / f"{name}.parquet"
            runs.append(
                cli.run(
                    f"visbatch results {name} --format parquet ({n:,} rows)",
                    ["results", job[:12], "--format", "parquet", "-o", str(out)],
                )
            )
            runs[-1].note += f" {out.stat().st_size / 2**20:.0f} MiB" if out.exists() else " no file"
            out.unlink(missing_ok=True)

        if "export" not in skip:
            export("B", job_b, rows_b)
        if "view" not in skip:
            runs.extend(time_view(cli, job_a[:12], url))
        if "compare" not in skip:
            runs.append(
                cli.run(
                    f"visbatch compare A B ({rows_b // len(PROMPTS):,} shared pages)",
                    ["compare", job_a[:12], job_b[:12], "--json"],
                )
            )
        if "queries" not in skip:
            queries = time_queries(url, job_a, documented_queries())
        if "purge" not in skip and purge_available(cli):
            runs.append(
                cli.run(
                    "visbatch purge --older-than 30d --dry-run", ["purge", "--older-than", "30d", "--dry-run"]
                )
            )
            runs.append(cli.run(f"visbatch purge --job B ({rows_b:,} rows)", ["purge", "--job", job_b[:12]]))
        if "export" not in skip:  # last: the longest (the rest is measured if time runs out)
            export("A", job_a, rows_a)
    figures["runs"] = [vars(r) for r in runs]
    figures["queries"] = [vars(q) for q in queries]
    figures["load_after"] = loadavg()
    if not args.keep:
        drop_database(args.database)

    status = next((r for r in runs if r.what.startswith("visbatch status A (")), None)
    checks = [
        Check(
            f"visbatch status at {rows_a:,} rows", status and round(status.seconds, 2), "<=", 1.0, unit=" s"
        )
    ]
    exports = [r for r in runs if "--format parquet" in r.what]
    if len(exports) == 2:
        ratio = exports[1].max_rss_mb / max(exports[0].max_rss_mb, 1)
        figures["export_rss_ratio_a_vs_b"] = round(ratio, 2)
        checks.append(Check("parquet export peak RSS, A (10x rows) / B", round(ratio, 2), "<=", 1.5))
    labels = [r.what for r in runs]
    name = "db_scale" + (f"_{args.label}" if args.label else "")
    write_result(
        name,
        quick=rows < 10_000_000,
        question="The database at scale: a user's commands on a job of 10M result rows",
        baseline="the same commands at 1/10 of the rows (job B), and the code before the fixes (--tree)",
        reps=3,
        checks=checks,
        figures=figures,
        chart=bars(labels, [round(r.seconds, 2) for r in runs], "seconds", "db_scale", log=True),
    )


def purge_available(cli: Cli) -> bool:
    done = subprocess.run([*cli.argv, "purge", "--help"], env=cli.env, cwd=cli.cwd, capture_output=True)
    return done.returncode == 0


if __name__ == "__main__":
    main()
