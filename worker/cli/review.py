"""`visbatch view` and `visbatch compare` (registered on the main app by ``register``).

Both only read: the database (SQLite or PostgreSQL, from VISBATCH_DATABASE_URL) and the object
store (folder or S3, from VISBATCH_STORE_URL); no model, no torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from storage.db import Database
    from storage.object_store import ObjectStore
    from visbatch.settings import Settings

console = Console(stderr=True)

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _fail(message: str) -> None:
    console.print(Text.assemble(("error: ", "bold red"), message))
    raise typer.Exit(2)


def _open() -> tuple[Settings, Database, ObjectStore]:
    # Imported here: the main CLI registers these commands at start-up, which must stay cheap.
    from storage.db import Database
    from storage.object_store import open_object_store
    from visbatch.settings import Settings

    settings = Settings()
    db = Database(settings.sqlalchemy_url())
    store = open_object_store(settings.object_store_url(), endpoint_url=settings.s3_endpoint_url)
    return settings, db, store


def view(
    job: Annotated[str, typer.Argument(help="Job id or a unique prefix (6+ hex digits).")],
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the site to this folder instead of serving it.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to serve on (no login: keep it local).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to serve on (0: any free port).", min=0, max=65535)] = 8000,
    per_page: Annotated[int, typer.Option(help="Pages or frames per review page.", min=1, max=1000)] = 50,
) -> None:
    """Review a job: each page or frame beside every answer, with errors, skips and tokens.
    Serves it over local HTTP, or writes a static site with --out DIR (open DIR/index.html)."""
    # A database that is down or not migrated is the command group's to explain (exit 4, the
    # same two lines as every command: worker.errors).
    from storage.repository import JobNotFound
    from worker.review.images import Thumbnails, default_thumbnail_dir, remove_folder
    from worker.review.site import ReviewSite

    settings, db, store = _open()
    try:
        site = ReviewSite(db, store, job, per_page=per_page)
        if out is not None:
            from worker.review.export import export_site

            report = export_site(site, out, progress=lambda uri: console.print(Text(f"  {uri}", style="dim")))
            for key in report.missing_images[:20]:
                console.print(Text(f"missing from the store: {key}", style="yellow"))
            print(f"wrote {report.pages} pages and {report.images} images to {out / 'index.html'}")
            return
    except JobNotFound as exc:
        _fail(str(exc))
    from worker.review.server import make_server

    thumb_dir, temporary = default_thumbnail_dir(settings.resolved_home)
    site.thumbnails = Thumbnails(store, thumb_dir)
    try:
        server = make_server(site, host, port)
    except OSError as exc:
        _fail(f"cannot serve on {host}:{port}: {exc}")
    if host not in LOCAL_HOSTS:
        console.print(f"[yellow]warning:[/] serving on {host}: no login, anyone who reaches it reads the job")
    bound_host, bound_port = server.server_address[:2]
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host
    # stdout, flushed: a script (or a test) reads the address from the first line.
    print(f"serving job {site.job_id} at http://{shown}:{bound_port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if temporary:
            remove_folder(thumb_dir)


def compare(
    job_a: Annotated[str, typer.Argument(help="The reference run (id or unique prefix).")],
    job_b: Annotated[str, typer.Argument(help="The run to check against it.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write a report with the differing pages side by side.")
    ] = None,
    limit: Annotated[
        int, typer.Option(help="Differing pages listed (--json, --html); counts cover all.", min=0)
    ] = 1000,
    show: Annotated[int, typer.Option(help="Differing answers printed in the terminal table.", min=0)] = 20,
) -> None:
    """Agreement of two runs over the same sources and prompts (e.g. --detail low against high):
    per prompt (exact text, JSON field by field), visual tokens each spent, pages where they differ."""
    from storage.repository import JobNotFound
    from worker.review.compare import CompareError, compare_jobs

    _, db, store = _open()
    try:
        comparison = compare_jobs(db, job_a, job_b, page_limit=limit)
    except (JobNotFound, CompareError) as exc:
        _fail(str(exc))
        raise  # unreachable
    if html is not None:
        from worker.review.compare_html import write_compare_site

        missing = write_compare_site(comparison, store, html)
        for key in missing[:20]:
            console.print(Text(f"missing from the store: {key}", style="yellow"))
        console.print(f"wrote {html / 'index.html'}")
    if as_json:
        json.dump(comparison.to_json(), sys.stdout, indent=2, default=str, ensure_ascii=False)
        sys.stdout.write("\n")
        return
    _print_comparison(comparison, show)


def _rate(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.1%}"


def _print_comparison(c: Any, show: int) -> None:
    from worker.review.compare import answer_summary, terminal_safe
    from worker.review.html import unit_label

    out = Console()
    jobs = Table("", "job", "budget", "visual tokens (job)", "visual tokens (shared units)", title="runs")
    shared_tokens = c.visual_tokens_shared
    for name, info, shared in (("A", c.job_a, shared_tokens[0]), ("B", c.job_b, shared_tokens[1])):
        budget = {k: v for k, v in (info.spec.get("budget") or {}).items() if v not in (None, False)}
        jobs.add_row(
            name,
            info.id,
            Text(json.dumps(budget) if budget else "model defaults"),
            f"{info.tokens['spent']['visual']:,}",
            f"{shared:,}",
        )
    out.print(jobs)
    out.print(
        f"{c.units_shared:,} pages/frames shared ({c.units_only_a:,} only in A, "
        f"{c.units_only_b:,} only in B), {c.sources_shared:,} sources; {c.differing_units:,} differ"
    )
    prompts = Table("prompt", "kind", "compared", "agree", "agreement", "differ", "failed A", "failed B",
                    "no answer A", "no answer B", title="agreement per prompt")  # fmt: skip
    for p in c.prompts:
        prompts.add_row(
            Text(terminal_safe(p.prompt, 50)),
            "JSON" if p.json_pairs else "text",
            f"{p.compared:,}",
            f"{p.agree:,}",
            _rate(p.rate),
            f"{p.differ:,}",
            f"{p.failed_a:,}",
            f"{p.failed_b:,}",
            f"{p.missing_a:,}",
            f"{p.missing_b:,}",
        )
        for path, f in p.fields.items():
            name = Text(f"  .{terminal_safe(path, 46)}")
            prompts.add_row(name, "field", f"{f.compared:,}", f"{f.agree:,}", _rate(f.rate))
    out.print(prompts)
    if c.prompts_only_a or c.prompts_only_b:
        only = f"prompts only in A {c.prompts_only_a!r}, only in B {c.prompts_only_b!r}"
        out.print(Text(f"not compared: {only}"))
    if not c.pages or show == 0:
        return
    diffs = Table("source", "unit", "prompt", "A", "B", title="differing answers")
    shown, listed = 0, sum(len(d.answers) for d in c.pages)
    for d in c.pages:
        for answer in d.answers:
            if shown == show:
                break
            diffs.add_row(
                Text(terminal_safe(Path(d.uri).name, 30)),
                unit_label(d.kind, d.unit_index, d.timestamp),
                Text(terminal_safe(answer.prompt, 30)),
                Text(terminal_safe(answer_summary(answer.output_a, answer.text_a, answer.error_a))),
                Text(terminal_safe(answer_summary(answer.output_b, answer.text_b, answer.error_b))),
            )
            shown += 1
    out.print(diffs)
    if c.differing_units > len(c.pages) or shown < listed:
        out.print("more differences: --json or --html DIR lists them all")


def register(app: typer.Typer) -> None:
    app.command("view")(view)
    app.command("compare")(compare)
