"""The `visbatch` command.

Only light modules are imported here (typer, rich, the spec): `status`, `results`, `plan` and
friends start in well under a second and never import torch; the model is loaded by `run`,
`resume` and `worker` alone, when they need it. Errors are turned into one or two lines with a
documented exit code by the command group (worker.cli_errors); job options are declared once
(worker.cli_options); what is printed, and how in a pipe, is worker.cli_output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ingest.spec import JobSpec
from storage.settings import Settings
from worker.budget_options import token_lines
from worker.cli_errors import (
    DEBUG_META_KEY,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PARTIAL,
    EXIT_UNAVAILABLE,
    MODEL_FIX,
    UserError,
    first_line,
)
from worker.cli_group import VisbatchGroup
from worker.cli_inputs import chosen_files
from worker.cli_options import JobOptions, job_options
from worker.cli_output import make_console, print_preview, print_summary, progress_display, shown_path
from worker.review.cli import register as _register_review

# Plain (click) help: rich's boxed help cuts option names at 80 columns ("--max-tokens-pe...").
app = typer.Typer(
    cls=VisbatchGroup,
    help="Run vision-language models over piles of PDFs, videos and images; answers in SQL.",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="Choose or build the model.", no_args_is_help=True, rich_markup_mode=None)
db_app = typer.Typer(help="Database helpers.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(model_app, name="model")
app.add_typer(db_app, name="db")

console = make_console(stderr=True)
out = make_console(stderr=False)

Paths = Annotated[
    list[Path], typer.Argument(metavar="PATH", help="Files or folders (walked).", show_default=False)
]
JobId = Annotated[str, typer.Argument(metavar="JOB", help="Job id or a unique prefix (6+ hex digits).")]


def _runtime(model: str | None):
    from worker.runtime import Runtime

    return Runtime(Settings(), model=model)


def _model_origin(rt: Any, explicit: str | None) -> str:
    if explicit:
        return "--model"
    origin = rt.settings.model_origin
    if origin == "default":
        return "the built-in default; `visbatch model use` changes it"
    return origin if origin == "VISBATCH_MODEL" else shown_path(origin)


def _prepare_model(rt: Any, explicit: str | None, *, weights: bool = True) -> None:
    """Say which model the command uses, and fail in seconds, with the fix, when it cannot be
    had: the token rule (its small JSON files) first, then the weights."""
    console.print(f"model: {escape(rt.model_name)} (from {escape(_model_origin(rt, explicit))})")
    # Loading bars of the hub and transformers are noise in a log; the model line says what loads.
    # (Read when huggingface_hub is imported: before the token rule below imports it.)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    rt.token_rule  # noqa: B018 - ModelFilesUnavailable here is exit 4 with the fix (cli_errors)
    if not weights:
        return
    try:
        rt.adapter.visual_tokens(448, 448)
    except Exception as exc:
        raise UserError(
            f"cannot load model {rt.model_name!r}: {first_line(exc)}", MODEL_FIX, EXIT_UNAVAILABLE
        ) from exc


_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def _stop_on_signals(run: Any) -> Iterator[None]:
    """SIGINT and SIGTERM stop the run promptly (the job ends cancelled, its work kept); a second
    signal exits at once."""
    previous = {sig: signal.getsignal(sig) for sig in _SIGNAL_NAMES}

    def handler(signum: int, _frame: Any) -> None:
        if run.stop.is_set():
            os._exit(128 + signum)
        run.request_stop(f"interrupted by {_SIGNAL_NAMES[signal.Signals(signum)]}")

    for sig in _SIGNAL_NAMES:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _exit_for(status: str) -> None:
    if status != "succeeded":
        raise typer.Exit(EXIT_PARTIAL if status == "partial" else EXIT_FAILED)


def _results_hint(job_id: str) -> str:
    return (
        f"all answers: visbatch results {job_id}  (--format csv|parquet -o FILE, "
        f"--by-document DIR; status: visbatch status {job_id})"
    )


MetricsPort = Annotated[
    int | None,
    typer.Option(metavar="PORT", help="Serve Prometheus metrics of this run on PORT (off by default)."),
]


def _run_embedded(rt: Any, start: Any, metrics_port: int | None = None) -> None:
    """Run (or resume) a job in this process with progress; print its id on stdout before any
    work starts, its summary, first answers and the results command on stderr at the end; exit
    with the job's status code."""
    from storage import repository as repo
    from worker.embedded import EmbeddedRun

    job: dict[str, str] = {}

    def on_job(job_id: str) -> None:
        job["id"] = job_id
        print(job_id, flush=True)  # stdout: a script can always resume or inspect it
        console.print(f"job {job_id} started")

    with progress_display(console) as progress:
        embedded = EmbeddedRun(rt, progress)
        if metrics_port is not None:
            from worker import metrics

            metrics.serve(
                metrics_port,
                host="127.0.0.1",
                collectors=[
                    metrics.job_states(rt.settings.sqlalchemy_url()),
                    metrics.QueueDepthCollector(embedded.queue_depths),
                ],
            )
        with _stop_on_signals(embedded):
            start(embedded, on_job)
    summary = repo.job_summary(rt.db, job["id"])
    print_summary(console, summary)
    done = embedded.work_done()
    console.print(
        f"this run: {done['split']} pages/frames split, {done['tower_images']} images through the "
        f"vision tower, {done['answers']} answers generated"
    )
    if embedded.stop_reason is not None:
        console.print(
            f"stopped: job {job['id']} cancelled ({escape(embedded.stop_reason)}); finished work is kept. "
            f"Resume with: visbatch resume {job['id']}"
        )
        raise typer.Exit(EXIT_INTERRUPTED)
    prompts = list(summary["spec"].get("prompts") or [])
    print_preview(console, job["id"], prompts, repo.preview_results(rt.db, job["id"], per_prompt=3))
    console.print(_results_hint(job["id"]))
    _exit_for(summary["status"])


@app.command()
@job_options()
def run(paths: Paths, job: JobOptions, metrics_port: MetricsPort = None) -> None:
    """Run a job in this process (embedded shape). Prints the job id on stdout first; progress,
    the summary and the first answers go to stderr. Exit 0 when every page/frame was answered,
    1 partial, 2 bad input, 3 failed, 4 model or database unavailable, 130 interrupted."""
    spec = job.spec()
    files = chosen_files(paths, job)
    rt = _runtime(job.model)
    _prepare_model(rt, job.model)
    _run_embedded(rt, lambda embedded, on_job: embedded.run(files, spec, on_job), metrics_port)


@app.command()
def resume(job: JobId, metrics_port: MetricsPort = None) -> None:
    """Continue a stopped job (cancelled, interrupted, failed or partial) in place: no page
    rendered or image encoded twice, only the missing answers generated."""
    from storage import repository as repo

    rt = _runtime(None)
    full_id = repo.resolve_job_id(rt.db, job)
    state = repo.job_state(rt.db, full_id)
    assert state is not None
    if state[0] == "succeeded":
        raise UserError(
            f"job {full_id} succeeded: nothing to resume", f"its answers: visbatch results {full_id}"
        )
    model = state[1].get("model")
    rt = _runtime(model)
    _prepare_model(rt, model)
    _run_embedded(rt, lambda embedded, on_job: embedded.resume(full_id, on_job), metrics_port)


@app.command()
@job_options()
def submit(
    inputs: Annotated[
        list[str],
        typer.Argument(
            metavar="INPUT",
            help="Files, folders, s3://bucket/key or s3://bucket/prefix/.",
            show_default=False,
        ),
    ],
    job: JobOptions,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress until the job ends.")] = False,
) -> None:
    """Send a job to the fleet (Celery workers); prints its id. Local files are uploaded to the store."""
    from worker.submit import submit_job

    spec = job.spec()
    local = [Path(item) for item in inputs if not item.startswith("s3://")]
    files = [str(path) for path in chosen_files(local, job)] if local else []
    remote = [item for item in inputs if item.startswith("s3://")]
    rt = _runtime(job.model)
    job_id = submit_job(rt, files + remote, spec)
    print(job_id, flush=True)
    if wait:
        _wait(rt, job_id)
    else:
        console.print(f"follow it: visbatch status {job_id}; answers: visbatch results {job_id}")


def _wait(rt: Any, job_id: str) -> None:
    from storage import repository as repo
    from worker.submit import wait_for_job

    with progress_display(console) as progress:

        def show(s: dict) -> None:
            prompts = len(s["spec"]["prompts"])
            done = s["units_total"] - s.get("units_pending", 0)
            progress.update("units", max(0, done), s["units_total"] or None)
            progress.update(
                "generate", s["results"] + s["results_failed"], (s["units_total"] * prompts) or None
            )

        summary = wait_for_job(rt, job_id, show)
    print_summary(console, summary)
    prompts = list(summary["spec"].get("prompts") or [])
    print_preview(console, job_id, prompts, repo.preview_results(rt.db, job_id, per_prompt=3))
    console.print(_results_hint(job_id))
    _exit_for(summary["status"])


@app.command()
def watch(
    prefix: Annotated[str, typer.Argument(help="s3://bucket/inbox/ to poll.")],
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Default prompt(s).")] = None,
    spec_file: Annotated[Path | None, typer.Option("--spec", help="Default job spec (JSON).")] = None,
    done_prefix: Annotated[str, typer.Option(help="Move processed objects here ('' keeps them).")] = "done/",
    failed_prefix: Annotated[
        str, typer.Option(help="Move objects whose job failed to start here.")
    ] = "failed/",
    poll_seconds: Annotated[float, typer.Option(help="Seconds between listings.")] = 5.0,
    log_level: Annotated[
        str, typer.Option(help="The watcher's log level: INFO shows every job made and every re-drop.")
    ] = "INFO",
) -> None:
    """Turn each object dropped under an S3 prefix into one fleet job, exactly once (a _spec.json
    beside the objects may give their prompts and schema). Refuses (exit 2) a prefix that holds
    the object store, the token cache or another watcher's folders."""
    import signal
    import threading

    from ingest.drop_guard import WatcherRefused
    from ingest.dropfolder import DropFolderWatcher
    from ingest.spec import SpecError, spec_from_json
    from worker.submit import submit_job

    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise UserError(f"--log-level {log_level}: not a level", "use DEBUG, INFO, WARNING or ERROR")
    # A daemon's log is its only voice: the watcher's own lines at INFO by default, whatever the
    # other commands' quieter default (libraries stay at the root level; --verbose wins).
    if logging.getLogger().level != logging.DEBUG:
        logging.getLogger("ingest").setLevel(level)
    default = None
    if spec_file is not None:
        try:
            default = spec_from_json(spec_file.read_bytes())
        except (OSError, SpecError) as exc:
            raise UserError(f"--spec {spec_file}: {exc}") from None
    elif prompt:
        default = JobSpec(prompts=prompt)
    rt = _runtime(None)
    try:
        watcher = DropFolderWatcher.from_settings(
            rt.settings,
            prefix,
            rt.db,
            lambda uris, spec: submit_job(rt, uris, spec),
            default_spec=default,
            done_prefix=done_prefix or None,
            failed_prefix=failed_prefix or None,
            poll_seconds=poll_seconds,
        )
    except ValueError as exc:  # WatcherRefused included: one line, exit 2
        raise UserError(str(exc)) from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        watcher.run(stop)
    except WatcherRefused as exc:
        raise UserError(str(exc)) from None
    except KeyboardInterrupt:
        stop.set()


@app.command()
def cancel(job: JobId) -> None:
    """Stop a fleet job's remaining work; what is done stays."""
    from storage import repository as repo
    from worker.submit import cancel_job

    rt = _runtime(None)
    job_id = cancel_job(rt, job)
    console.print(f"job {job_id}: {repo.job_summary(rt.db, job_id)['status']}")


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option(help="Comma-separated: ingest, encode, generate.")
    ] = "ingest,encode,generate",
    concurrency: Annotated[
        int | None,
        typer.Option(
            help="ingest alone: processes (default: the cores). With encode/generate: task threads "
            "(default: the generate window, VISBATCH_GENERATE_WINDOW, or 16 for encode alone)."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Worker name (default: from the queues and host).")] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(metavar="PORT", help="Prometheus metrics port (default: $VISBATCH_METRICS_PORT, 9808)."),
    ] = None,
    metrics: Annotated[bool, typer.Option("--metrics/--no-metrics", help="Serve Prometheus metrics.")] = True,
) -> None:
    """Start a Celery worker: processes for ingest alone; for GPU stages one process (the model loaded
    once) whose task threads feed one engine loop: start one worker per GPU."""
    from worker.celery_app import QUEUES, queue_name
    from worker.celery_app import app as celery_app

    chosen = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(chosen) - set(QUEUES))
    if unknown or not chosen:
        raise UserError(
            f"--queues {queues}: unknown queue(s) {', '.join(unknown) or '(none)'}",
            f"choose from {', '.join(QUEUES)}",
        )
    settings = Settings()
    argv = [
        "worker",
        "-Q",
        ",".join(queue_name(settings, q) for q in chosen),
        "--loglevel",
        loglevel,
        # One message per pool slot: a GPU worker's threads hold exactly the units in its window.
        "--prefetch-multiplier",
        "1",
        "-n",
        name or f"visbatch-{'-'.join(chosen)}-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
    if metrics:
        _serve_worker_metrics(settings, metrics_port, prefork=not {"encode", "generate"} & set(chosen))
    if {"encode", "generate"} & set(chosen):
        # Task threads mostly wait on the process's one engine loop; they are the window of
        # messages (units) in flight, acknowledged as each unit's results are stored.
        default = settings.generate_window or 64 if "generate" in chosen else 16
        argv += ["-P", "threads", "-c", str(concurrency or default)]
    else:
        # Recycle ingest processes now and then: PDF and video libraries can hold on to memory.
        argv += [
            "-P",
            "prefork",
            "-c",
            str(concurrency or os.cpu_count() or 1),
            "--max-tasks-per-child",
            "200",
        ]
    celery_app.worker_main(argv)


def _serve_worker_metrics(settings: Settings, port: int | None, *, prefork: bool) -> None:
    if prefork and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Tasks run in pool processes: their metrics are summed by the parent's endpoint. Set
        # before prometheus_client is first imported (it picks its value store on import).
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="visbatch-metrics-")
    from worker import metrics

    port = settings.metrics_port if port is None else port
    metrics.serve(
        port, collectors=[metrics.job_states(settings.sqlalchemy_url()), metrics.broker_queues(settings)]
    )


@app.command()
@job_options("inputs", "model", "ingest")
def ingest(
    paths: Paths,
    job: JobOptions,
    out_dir: Annotated[
        Path, typer.Option("--out", metavar="DIR", help="Folder for the page and frame images.")
    ],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace --out if it holds a previous ingest.")
    ] = False,
    processes: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="Processes rendering a PDF's pages (default: the CPU cores)."),
    ] = None,
) -> None:
    """Split sources into page and frame images (PNG) and a manifest.jsonl: the ingest stage alone.
    No GPU, no weights; visual-token counts when a model is named (--model or VISBATCH_MODEL).

    Exit 0 when every source and unit was written, 1 when some failed, 3 when none was, 2 for a
    usage error, 130 when interrupted (--out is then left as it was)."""
    from worker.ingest_cli import run_ingest

    files = chosen_files(paths, job)
    run_ingest(files, out_dir, job.model, job.ingest(), processes=processes, overwrite=overwrite)


@app.command()
def status(
    job: JobId, as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False
) -> None:
    """A job's state, counters and every error: the source, the page (from 1) or frame time, and
    the prompt it concerns."""
    from storage import repository as repo

    summary = repo.job_summary(_runtime(None).db, job)
    if as_json:
        # Plain print: machine-readable output must not be wrapped or styled.
        print(json.dumps(summary, default=str, indent=2))
    else:
        print_summary(out, summary)


@app.command()
def results(
    job: JobId,
    fmt: Annotated[str, typer.Option("--format", metavar="FORMAT", help="jsonl, csv or parquet.")] = "jsonl",
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="File (default: stdout; parquet needs one)."),
    ] = None,
    by_document: Annotated[
        Path | None,
        typer.Option(
            "--by-document",
            metavar="DIR",
            help="One file per source in DIR, pages in order: Markdown (text answers) or JSON "
            "(schema answers).",
        ),
    ] = None,
) -> None:
    """Every answer with its source, page number (from 1) or timestamp, and prompt text; jsonl
    and csv stream to stdout, parquet needs -o FILE."""
    from storage import repository as repo
    from worker.results_export import (
        FORMATS,
        export_records,
        write_by_document,
        write_csv,
        write_jsonl,
        write_parquet,
    )

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: not a format", f"use {', '.join(FORMATS)}")
    if fmt == "parquet" and output is None and by_document is None:
        raise UserError("--format parquet writes a file", "add -o FILE (e.g. -o answers.parquet)")
    rt = _runtime(None)
    summary = repo.job_summary(rt.db, job, max_errors=0)
    prompts = list(summary["spec"].get("prompts") or [])
    records = export_records(repo.iter_results(rt.db, summary["id"]), prompts)
    if by_document is not None:
        as_json = summary["spec"].get("json_schema") is not None
        written = write_by_document(records, by_document, prompts, as_json=as_json)
        kind = "JSON" if as_json else "Markdown"
        console.print(f"wrote {len(written)} {kind} file(s), one per source, to {by_document}")
        return
    if fmt == "parquet":
        assert output is not None
        count = write_parquet(records, output)
    else:
        writer = write_csv if fmt == "csv" else write_jsonl
        with contextlib.ExitStack() as stack:
            handle = stack.enter_context(open(output, "w", newline="")) if output else sys.stdout
            count = writer(records, handle)
    if output is not None:
        console.print(f"wrote {count} answer(s) to {output}")
    for key, value in token_lines(summary.get("tokens")):  # stderr: the records stay clean on stdout
        console.print(f"{key}: {value}")


@app.command()
def jobs(limit: Annotated[int, typer.Option(metavar="N", help="How many, newest first.")] = 20) -> None:
    """Recent jobs: status, when, and how many pages/frames, answers and errors."""
    from storage import repository as repo

    rt = _runtime(None)
    # No borders, nothing cut: fits 80 columns with a 12-digit id (any unique prefix works).
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name in ("id", "status", "created (UTC)", "sources", "pages", "answers", "errors"):
        table.add_column(
            name,
            no_wrap=True,
            justify="right" if name in ("sources", "pages", "answers", "errors") else "left",
        )
    for item in repo.list_jobs(rt.db, limit=limit):
        created = str(item["created_at"] or "")[:16].replace("T", " ")
        errors = sum(int(item.get(key) or 0) for key in ("sources_failed", "units_failed", "results_failed"))
        answers = int(item.get("results_total") or 0) - int(item.get("results_failed") or 0)
        table.add_row(
            item["id"][:12], item["status"], created, str(item.get("sources_total") or 0),
            str(item.get("units_total") or 0), str(answers), str(errors),
        )  # fmt: skip
    out.print(table)


def _register_plan() -> None:
    from worker.plan_cli import plan

    app.command("plan")(plan)


_register_plan()
_register_review(app)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to write the model into.")],
    seed: Annotated[int, typer.Option()] = 0,
    family: Annotated[
        str, typer.Option(help="qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3-vl-moe or idefics3 (or qwen3_vl, ...).")
    ] = "qwen2_vl",
) -> None:
    """Write a tiny RANDOM model of a supported family that loads offline (for tests and demos;
    its answers are meaningless)."""
    from worker.models.tiny import normalize_family, write_tiny_model

    try:
        family = normalize_family(family)
    except ValueError as exc:
        raise UserError(f"--family {family}: {exc}") from None
    write_tiny_model(out_dir, family=family, seed=seed)
    console.print(f"wrote a tiny random {family} to {out_dir} (random weights: outputs are meaningless)")
    console.print(f"make it this folder's default: visbatch model use {out_dir}")


@model_app.command("use")
def model_use(
    model: Annotated[
        str, typer.Argument(metavar="ID|DIR", help="Hub id (Qwen/Qwen2-VL-2B-Instruct) or model folder.")
    ],
) -> None:
    """Make this model the default of the commands run here ($VISBATCH_HOME/config.json);
    VISBATCH_MODEL and --model still win."""
    from storage.settings import write_home_config
    from worker.runtime import resolve_model_name

    folder = Path(model).expanduser()
    if (folder.exists() or model.startswith((".", "/", "~"))) and not (folder / "config.json").is_file():
        raise UserError(f"{model}: not a model folder (no config.json)", MODEL_FIX)
    settings = Settings()
    path = write_home_config(settings.home, model=resolve_model_name(model))
    console.print(f"default model: {resolve_model_name(model)} (recorded in {shown_path(str(path))})")


@model_app.command("show")
def model_show() -> None:
    """The model a command uses here, and where that choice comes from."""
    settings = Settings()
    origin = settings.model_origin
    print(settings.model)
    console.print(f"from {shown_path(origin) if origin not in ('default', 'VISBATCH_MODEL') else origin}")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the database migrations (SQLite or PostgreSQL from VISBATCH_DATABASE_URL)."""
    from storage.db import Database

    db = Database(Settings().sqlalchemy_url())
    before = db.current_revision()
    db.upgrade()
    after = db.current_revision()
    if before == after:
        console.print(f"database {db.masked_url}: already at the latest migration ({after})")
    else:
        console.print(f"database {db.masked_url}: migrated from {before or 'empty'} to {after} (the latest)")


@app.callback()
def _main(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of an error (also VISBATCH_DEBUG=1).")
    ] = False,
) -> None:
    ctx.meta[DEBUG_META_KEY] = debug
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
