"""`visbatch purge` (registered on the main app by ``register``): retention of finished jobs.

"prune" means token pruning in visbatch (`--prune-keep`); deleting old jobs is "purge". What it
deletes and in which order is storage.retention's; this module parses the age, shows what would
go (--dry-run) and reports what went.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from worker.errors import UserError

if TYPE_CHECKING:
    from storage.retention import Purged

_AGE = re.compile(r"(\d+)\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_age(text: str) -> timedelta:
    """'30d', '12h', '2w', '90m', '45s' (m: minutes) -> timedelta; ValueError otherwise."""
    match = _AGE.fullmatch(text.strip().lower())
    if not match:
        raise ValueError(f"{text!r} is not an age: a number and one of s, m, h, d, w (e.g. 30d)")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def kept_lines(done: Purged) -> list[str]:
    """Why the cached entries that stay stay: a queued or running job uses or will use them (each
    such job named, with how many it needs), or a finished job that stays names them."""
    lines = []
    if done.entries_kept_live:
        jobs = sorted(done.kept_for, key=lambda j: (-done.kept_for[j], j))
        if len(jobs) == 1:
            whose = f"{done.live_status[jobs[0]]} job {jobs[0][:12]} uses or will use"
        else:
            each = ", ".join(f"{done.live_status[j]} {j[:12]} ({done.kept_for[j]:,})" for j in jobs)
            whose = f"{len(jobs)} queued or running jobs use or will use: {each}"
        lines.append(f"kept {done.entries_kept_live:,} cached token entries that {whose}")
    if done.entries_kept_shared:
        lines.append(
            f"kept {done.entries_kept_shared:,} cached token entries that finished jobs not purged use"
        )
    return lines


def purge(
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than",
            metavar="AGE",
            help="Purge every finished job that finished more than AGE ago: 30d, 12h, 2w (s m h d w).",
        ),
    ] = None,
    job: Annotated[
        str | None, typer.Option("--job", metavar="JOB", help="Purge this one job (id or unique prefix).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")
    ] = False,
    keep_cache: Annotated[
        bool, typer.Option("--keep-cache", help="Leave the cached visual tokens alone (rows only).")
    ] = False,
) -> None:
    """Delete finished jobs and the cached tokens no other job uses.

    A job's results, pages/frames and sources, and the cached visual tokens no remaining job uses
    (running jobs are never purged). In batches: no long lock."""
    from rich.console import Console
    from rich.table import Table

    from storage import retention
    from storage.models import utcnow
    from visbatch.settings import Settings
    from worker.runtime import Runtime

    # soft_wrap: a line is never cut at the terminal width (scripts read these lines).
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    out = Console(highlight=False)
    if (older_than is None) == (job is None):
        raise UserError(
            "give --older-than AGE or --job JOB (one of them)", "e.g. visbatch purge --older-than 30d"
        )
    before = None
    if older_than is not None:
        try:
            before = utcnow() - parse_age(older_than)
        except ValueError as exc:
            raise UserError(f"--older-than {exc}") from None
    rt = Runtime(Settings(), model=None, existing_db=True)  # nothing to purge in a database not there
    try:
        candidates = retention.find_purgeable(rt.db, before=before, job=job)
    except retention.JobRunning as exc:
        raise UserError(str(exc), f"visbatch cancel {job}") from None
    if not candidates:
        console.print(f"nothing to purge: no finished job older than {older_than}")
        return
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name in ("id", "status", "finished (UTC)", "sources", "pages", "answers"):
        table.add_column(
            name, no_wrap=True, justify="right" if name in ("sources", "pages", "answers") else "left"
        )
    for c in candidates:
        ended = c.finished_at or c.created_at
        table.add_row(
            c.id[:12], c.status, str(ended)[:16], f"{c.sources:,}", f"{c.units:,}", f"{c.results:,}"
        )
    out.print(table)
    ids = [c.id for c in candidates]
    totals = (
        f"{len(ids)} job(s): {sum(c.sources for c in candidates):,} sources, "
        f"{sum(c.units for c in candidates):,} pages/frames, {sum(c.results for c in candidates):,} answers"
    )
    if dry_run:
        entries = None if keep_cache else retention.preview_entries(rt.db, ids)
        count = "kept (--keep-cache)" if entries is None else f"{entries.cache_entries:,}"
        console.print(f"would delete {totals}; cached token entries no other job uses: {count}")
        for line in kept_lines(entries) if entries is not None else []:
            console.print(line)
        console.print("(dry run: nothing deleted)")
        return
    deleter = None if keep_cache else retention.cache_deleter(rt.cache)

    def progress(job_id: str, done: retention.Purged) -> None:
        if done.jobs:
            console.print(f"purged {job_id[:12]}: {done.results:,} answers, {done.units:,} pages/frames, "
                          f"{done.sources:,} sources, {done.cache_entries:,} cached entries")  # fmt: skip

    total = retention.purge_jobs(rt.db, ids, delete_entries=deleter, progress=progress)
    console.print(
        f"deleted {total.jobs} job(s): {total.sources:,} sources, {total.units:,} pages/frames, "
        f"{total.results:,} answers, {total.cache_entries:,} cached token entries"
    )
    for line in kept_lines(total):
        console.print(line)


def register(app: typer.Typer) -> None:
    app.command("purge")(purge)
