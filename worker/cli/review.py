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
    from storage.db import open_existing
    from storage.object_store import open_object_store
    from visbatch.settings import Settings

    settings = Settings()
    # As it is: reading never creates or migrates a database (worker.errors names where it looked).
    db = open_existing(settings.sqlalchemy_url())
    store = open_object_store(settings.object_store_url(), endpoint_url=settings.s3_endpoint_url)
    return settings, db, store


def view(
    job: Annotated[str, typer.Argument(metavar="JOB", help="Job id or a unique prefix (6+ hex digits).")],
    out: Annotated[
        Path | None,
        typer.Option("--out", metavar="DIR", help="Write the site to this folder instead of serving it."),
    ] = None,
    host: Annotated[
        str, typer.Option(metavar="HOST", help="Address to serve on (no login: keep it local).")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="PORT", help="Port to serve on (0: any free port).", min=0, max=65535)
    ] = 8000,
    per_page: Annotated[
        int, typer.Option(metavar="N", help="Pages or frames per review page.", min=1, max=1000)
    ] = 50,
) -> None:
    """Review a job's pages and frames beside their answers.

    Each page or frame beside every answer, with errors, skips and tokens. Serves it over local
    HTTP, or writes a static site with --out DIR (open DIR/index.html)."""
    # A database that is missing, down or not migrated, and a job it does not hold, are the
    # command group's to explain (exit 4 or 2, naming the database: worker.errors).
    from worker.review.images import Thumbnails, default_thumbnail_dir, remove_folder
    from worker.review.site import ReviewSite

    settings, db, store = _open()
    site = ReviewSite(db, store, job, per_page=per_page)
    if out is not None:
        from worker.review.export import export_site

        # The folder first: one that cannot be made is the only line (exit 2, worker.errors).
        out.mkdir(parents=True, exist_ok=True)
        # stderr: what each line is; stdout keeps the one line a script reads.
        # One line each, never wrapped: a path cut in two reads as two.
        console.print(Text(f"writing the review pages of job {site.job_id} to {out}:"), soft_wrap=True)

        def wrote(uri: str) -> None:
            console.print(Text(f"  wrote the pages of {uri}", style="dim"), soft_wrap=True)

        report = export_site(site, out, progress=wrote)
        for key in report.missing_images[:20]:
            console.print(Text(f"missing from the store: {key}", style="yellow"))
        print(f"wrote {report.pages} pages and {report.images} images to {out / 'index.html'}")
        return
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
    job_a: Annotated[str, typer.Argument(metavar="JOB_A", help="The reference run (id or unique prefix).")],
    job_b: Annotated[str, typer.Argument(metavar="JOB_B", help="The run to check against it.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document on stdout.")] = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html", metavar="DIR", help="Also write a report with the differing pages side by side."
        ),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(metavar="N", help="Differing pages listed (--json, --html); counts cover all.", min=0),
    ] = 1000,
    show: Annotated[
        int, typer.Option(metavar="N", help="Differing answers printed in the terminal table.", min=0)
    ] = 20,
) -> None:
    """Compare two runs' answers over the same sources and prompts.

    Their agreement (e.g. --detail low against high) per prompt (exact text, JSON field by
    field), the settings that tell them apart, the visual tokens each spent, and the pages where
    they differ."""
    from worker.review.compare import CompareError, compare_jobs

    _, db, store = _open()
    try:
        comparison = compare_jobs(db, job_a, job_b, page_limit=limit)
    except CompareError as exc:
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


def _setting(name: str, value: Any) -> str:
    """One setting of a job's spec as `name value` (None: the default, a schema by its digest)."""
    if name == "schema":
        if value is None:
            return "schema none"
        import hashlib

        digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]
        return f"schema {digest}"
    if value is None:
        return f"{name} default"
    if isinstance(value, bool):
        return f"{name} {'on' if value else 'off'}"
    if isinstance(value, float):
        return f"{name} {value:g}"
    return f"{name} {value}"


def _flat_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """A job spec's settings by their option names (the groups' fields: temperature, seed, detail
    ...), the prompts left out: they are matched and compared one by one."""
    flat: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "prompts":
            continue
        if key == "json_schema":
            flat["schema"] = value
        elif isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def settings_that_differ(spec_a: dict[str, Any], spec_b: dict[str, Any]) -> tuple[str, str]:
    """What tells two runs apart, each as `temperature 0.7, seed 3` (the same names in both, in
    the spec's order); "the same settings" when only their prompts could differ."""
    a, b = _flat_settings(spec_a), _flat_settings(spec_b)
    names = [*a, *(name for name in b if name not in a)]
    differ = [name for name in names if a.get(name) != b.get(name)]
    if not differ:
        return "the same settings", "the same settings"
    return (
        ", ".join(_setting(name, a.get(name)) for name in differ),
        ", ".join(_setting(name, b.get(name)) for name in differ),
    )


def _table(title: str) -> Table:
    # No borders: the columns get the 80 columns' width; figures never wrap or cut.
    return Table(title=title, box=None, pad_edge=False, show_edge=False, title_justify="left")


def _print_comparison(c: Any, show: int) -> None:
    from worker.results_export import place
    from worker.review.compare import answer_summary, terminal_safe

    out = Console()
    jobs = _table("runs")
    jobs.add_column("", no_wrap=True)
    jobs.add_column("job", no_wrap=True)  # any unique prefix works, as in `visbatch jobs`
    jobs.add_column("settings that differ", overflow="fold")
    jobs.add_column("visual\ntokens", justify="right", no_wrap=True)
    jobs.add_column("on shared\npages+frames", justify="right", no_wrap=True)
    differ = settings_that_differ(c.job_a.spec, c.job_b.spec)
    shared_tokens = c.visual_tokens_shared
    for name, info, settings, shared in zip("AB", (c.job_a, c.job_b), differ, shared_tokens, strict=True):
        jobs.add_row(name, info.id[:12], Text(settings), f"{info.tokens['spent']['visual']:,}", f"{shared:,}")
    out.print(jobs)
    out.print(
        f"{c.units_shared:,} pages/frames shared ({c.units_only_a:,} only in A, "
        f"{c.units_only_b:,} only in B), {c.sources_shared:,} sources; {c.differing_units:,} differ"
    )
    prompts = _table("agreement per prompt")
    prompts.add_column("prompt", overflow="fold")
    prompts.add_column("kind", no_wrap=True)
    for name in ("agree", "agreement", "failed\nA/B", "no answer\nA/B"):
        prompts.add_column(name, justify="right", no_wrap=True)
    for p in c.prompts:
        prompts.add_row(
            Text(terminal_safe(p.prompt, 200)),
            "JSON" if p.json_pairs else "text",
            f"{p.agree:,}/{p.compared:,}",
            _rate(p.rate),
            f"{p.failed_a:,}/{p.failed_b:,}",
            f"{p.missing_a:,}/{p.missing_b:,}",
        )
        for path, f in p.fields.items():
            name = Text(f"  .{terminal_safe(path, 100)}")
            prompts.add_row(name, "field", f"{f.agree:,}/{f.compared:,}", _rate(f.rate))
    out.print(prompts)
    out.print(Text("agree: answers alike / answered by both; failed, no answer: in A / in B", style="dim"))
    if c.prompts_only_a or c.prompts_only_b:
        only = f"prompts only in A {c.prompts_only_a!r}, only in B {c.prompts_only_b!r}"
        out.print(Text(f"not compared: {only}"))
    if not c.pages or show == 0:
        return
    diffs = _table("differing answers")
    diffs.add_column("source", overflow="fold")
    diffs.add_column("where", no_wrap=True)
    for name in ("prompt", "A", "B"):
        diffs.add_column(name, overflow="fold")
    shown, listed = 0, sum(len(d.answers) for d in c.pages)
    for d in c.pages:
        for answer in d.answers:
            if shown == show:
                break
            diffs.add_row(
                Text(terminal_safe(Path(d.uri).name, 60)),
                # As `run`'s answers and `status`'s errors say it: page 3, frame at 0:12.000.
                place(d.kind, d.unit_index, d.timestamp),
                Text(terminal_safe(answer.prompt, 80)),
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
