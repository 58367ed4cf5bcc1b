"""The `visbatch` command.

Only light modules are imported here (typer, rich, the settings): `status`, `jobs` and `results`
load SQLAlchemy Core and nothing heavier, and no command imports torch before it needs a model
(`run`, `resume`, `worker`). The commands that start work (`run`, `resume`, `submit`, `ingest`,
`plan`) are declared by the job spec's pydantic models and live in worker.cli.run, imported when
one of them is asked for. Errors are turned into one or two lines with a documented exit code by
the command group (worker.errors says what, worker.cli.exits with which code); job options are
declared once (worker.job_options, bound to typer in worker.cli.job_options); what is printed,
and how in a pipe, is worker.cli.output.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from visbatch.settings import Settings
from worker.cli.exits import DEBUG_META_KEY
from worker.cli.group import VisbatchGroup
from worker.cli.output import make_console, print_summary, shown_path, token_lines
from worker.cli.purge import register as _register_purge
from worker.cli.review import register as _register_review
from worker.cli.workers import register as _register_workers
from worker.errors import MODEL_FIX, Unavailable, UserError


class _Commands(VisbatchGroup):
    # Declared by the job spec's pydantic models, which the other commands do without.
    lazy_commands = {name: "worker.cli.run" for name in ("run", "resume", "submit", "ingest", "plan")}


# Plain (click) help: rich's boxed help cuts option names at 80 columns ("--max-tokens-pe...").
app = typer.Typer(
    cls=_Commands,
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

JobId = Annotated[str, typer.Argument(metavar="JOB", help="Job id or a unique prefix (6+ hex digits).")]


def _positive(value: float | None) -> float | None:
    """A float option that must be above 0 (typer's ``min=`` includes its bound): refused while
    the command line is read, exit 2 naming the option, like ``min=``'s."""
    if value is not None and value <= 0:
        raise typer.BadParameter(f"Input should be greater than 0, not {value:g}")
    return value


def make_runtime(model: str | None, *, existing_db: bool = False):
    """The runtime of a command. Those that start work (`run`, `submit`, `watch`) create and
    migrate the database they are pointed at, and say so; ``existing_db=True`` needs it there
    already (worker.runtime)."""
    from worker.runtime import Runtime

    return Runtime(Settings(), model=model, existing_db=existing_db, on_migrated=_say_migrated)


def _say_migrated(db: Any, migrated: Any) -> None:
    """One line when a command made the database or its newer tables (as `git init` says where):
    a mistyped VISBATCH_DATABASE_URL or another current folder shows at once."""
    from worker.errors import database_described

    where, how, _ = database_described()
    if migrated.from_revision is None:
        made = f"the database {where}" if db.is_sqlite else f"visbatch's tables in {where}"
        console.print(f"created {made} ({how})", highlight=False, soft_wrap=True)
    else:
        console.print(
            f"migrated the database {where} from {migrated.from_revision} to {migrated.to_revision}",
            highlight=False,
            soft_wrap=True,
        )


def stored_database(settings: Settings) -> Any:
    """The database of a command that only reads (`status`, `jobs`, `results`): as it is, never
    created or migrated, so that a wrong folder or URL is an error that names where it looked
    (exit 4), not an empty answer. Without the Runtime: these commands stay light."""
    from storage.db import open_existing

    return open_existing(settings.sqlalchemy_url())


_WATCH_S3_FIX = (
    "check the inbox's bucket, VISBATCH_S3_ENDPOINT_URL and the AWS credentials (AWS_ACCESS_KEY_ID, "
    "AWS_PROFILE ...)"
)


@app.command()
def watch(
    prefix: Annotated[str, typer.Argument(metavar="PREFIX", help="s3://bucket/inbox/ to poll.")],
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", "-p", metavar="TEXT", help="Default prompt(s).")
    ] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", metavar="FILE", help="Default job spec (JSON).")
    ] = None,
    done_prefix: Annotated[
        str, typer.Option(metavar="PREFIX", help="Move processed objects here ('' keeps them).")
    ] = "done/",
    failed_prefix: Annotated[
        str, typer.Option(metavar="PREFIX", help="Move objects whose job failed to start here.")
    ] = "failed/",
    poll_seconds: Annotated[
        float, typer.Option(metavar="S", help="Seconds between listings (> 0).", callback=_positive)
    ] = 5.0,
    log_level: Annotated[
        str,
        typer.Option(
            metavar="LEVEL", help="The watcher's log level: INFO shows every job made and every re-drop."
        ),
    ] = "INFO",
) -> None:
    """Make one fleet job of each file dropped under an S3 prefix.

    Each object becomes one job, exactly once (a _spec.json beside the objects may give their
    prompts and schema). Refuses (exit 2) a prefix that holds the object store, the token cache or
    another watcher's folders; exits 4 when its first listing cannot work (no such bucket, no
    credentials). S3 away for a while is waited out."""
    import threading

    from ingest.spec import JobSpec, SpecError, spec_from_json
    from storage.object_store import StoreUrlError
    from worker.drivers.dropfolder.guard import WatcherRefused, watch_layout
    from worker.drivers.dropfolder.watcher import DropFolderWatcher, protected_places
    from worker.drivers.fleet.submit import submit_job

    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise UserError(f"--log-level {log_level}: not a level", "use DEBUG, INFO, WARNING or ERROR")
    # A daemon's log is its only voice: the watcher's own lines at INFO by default, whatever the
    # other commands' quieter default (libraries stay at the root level; --verbose wins).
    if logging.getLogger().level != logging.DEBUG:
        for name in ("worker.drivers", "ingest"):  # the watcher, its guard and stall watch; ingest's
            logging.getLogger(name).setLevel(level)
    default = None
    if spec_file is not None:
        try:
            default = spec_from_json(spec_file.read_bytes())
        except (OSError, SpecError) as exc:
            raise UserError(f"--spec {spec_file}: {exc}") from None
    elif prompt:
        default = JobSpec(prompts=prompt)
    # The folders first: a mistyped prefix is refused before the database is made or opened.
    try:
        watch_layout(prefix, done_prefix or None, failed_prefix or None, protected_places(Settings()))
    except StoreUrlError as exc:
        fix = f"give the inbox as s3://BUCKET/PREFIX/ ({StoreUrlError.BUCKET_RULE})"
        raise UserError(f"PREFIX {exc}", fix) from None
    except WatcherRefused as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        raise UserError(str(exc), "give a folder such as done/ ('' keeps objects where they are)") from None
    rt = make_runtime(None)
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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    from worker.drivers.fleet.stall_watch import StallWatch

    safety_net = StallWatch(rt.settings).start()  # the watcher also resumes stalled fleet jobs
    try:
        watcher.run(stop)
    except WatcherRefused as exc:
        if type(exc.__cause__).__module__.startswith("botocore"):  # the first listing: exit 4
            raise Unavailable(str(exc), _WATCH_S3_FIX) from None
        raise UserError(str(exc)) from None
    except KeyboardInterrupt:
        stop.set()
    finally:
        safety_net.close()


@app.command()
def cancel(job: JobId) -> None:
    """Stop a job, fleet or embedded; its finished work stays.

    A fleet job's workers drop its remaining work; a job run in another process (`visbatch run`,
    `resume`) stops within seconds and exits 130, as on Ctrl-C. `visbatch resume JOB` continues
    it."""
    # storage.jobs itself, as `status` reads it: not the submit driver, which imports the job spec,
    # the Runtime and the stages (0.8 s idle, 3-6 s beside the run it stops, which holds the CPUs).
    from storage.jobs import job_state, resolve_job_id, set_job_status
    from storage.models import FINISHED_JOB_STATUSES

    db = stored_database(Settings())
    job_id = resolve_job_id(db, job)
    state = job_state(db, job_id)
    if state is not None and state[0] not in FINISHED_JOB_STATUSES:
        # What worker.drivers.fleet.submit.cancel_job writes: fleet tasks drop the job's work, an
        # embedded run (`visbatch run`, `resume`) stops within its poll (worker.cli.run).
        set_job_status(db, job_id, "cancelled", error="cancelled by the user; finished work is kept")
        state = job_state(db, job_id)
    console.print(f"job {job_id}: {state[0] if state else 'gone'}")


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option(metavar="QUEUES", help="Comma-separated: ingest, encode, generate.")
    ] = "ingest,encode,generate",
    concurrency: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            min=1,
            help="ingest alone: processes (default: the cores). With encode/generate: task threads "
            "(default: the generate window, VISBATCH_GENERATE_WINDOW, or 16 for encode alone).",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(metavar="NAME", help="Worker name (default: from the queues and host).")
    ] = None,
    loglevel: Annotated[
        str, typer.Option(metavar="LEVEL", help="Celery's log level: DEBUG, INFO, WARNING or ERROR.")
    ] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(
            metavar="PORT",
            min=0,
            max=65535,
            help="Prometheus metrics port (default: $VISBATCH_METRICS_PORT, 9808; the next free one "
            "when it is taken; 0: any free port, named in the log).",
        ),
    ] = None,
    metrics: Annotated[bool, typer.Option("--metrics/--no-metrics", help="Serve Prometheus metrics.")] = True,
    supervise: Annotated[
        bool,
        typer.Option(
            "--supervise/--no-supervise",
            help="Run the Celery worker in a child process restarted when it dies (a broker restart "
            "can crash it); --no-supervise where systemd or Kubernetes restarts it.",
        ),
    ] = True,
) -> None:
    """Start a fleet worker (Celery) for some or all stages.

    Processes for ingest alone; for GPU stages one process (the model loaded once) whose task
    threads feed one engine loop: start one worker per GPU."""
    from worker.drivers.fleet.celery_app import QUEUES, queue_name
    from worker.drivers.fleet.celery_app import app as celery_app

    chosen = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(chosen) - set(QUEUES))
    if unknown or not chosen:
        raise UserError(
            f"--queues {queues}: unknown queue(s) {', '.join(unknown) or '(none)'}",
            f"choose from {', '.join(QUEUES)}",
        )
    settings = Settings()
    from storage.object_store import check_store_urls

    check_store_urls(settings)  # here, not in a child the supervisor would start again and again
    if supervise:
        # The child names itself: each worker process is its own instance (worker.drivers.fleet.heartbeats).
        child = ["worker", "--queues", ",".join(chosen), "--loglevel", loglevel,
                 "--metrics" if metrics else "--no-metrics", "--no-supervise"]  # fmt: skip
        child += ["--name", name] if name else []
        child += ["--concurrency", str(concurrency)] if concurrency is not None else []
        child += ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
        raise typer.Exit(_supervised(child))
    from worker.drivers.fleet import heartbeats
    from worker.drivers.fleet.instance import this_instance

    instance = this_instance()
    name = name or f"visbatch-{'-'.join(chosen)}-{instance}@%h"
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
        name,
        "--without-gossip",
        "--without-mingle",
    ]
    port = None
    if metrics:
        port = _serve_worker_metrics(settings, metrics_port, prefork=not {"encode", "generate"} & set(chosen))
    card = heartbeats.card_for_this_process(instance, chosen, name=name, metrics_port=port)
    heartbeats.set_this_worker(card)  # beaten by the stall watch once Celery is ready
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
    if {"encode", "generate"} & set(chosen):
        rt = _load_default_model()
        if rt is not None and "generate" in chosen:
            _check_hot_tier(rt, concurrency or settings.generate_window)
    from worker.drivers.fleet.reconnect_logs import install as quiet_reconnects

    quiet_reconnects()  # a broker reconnect is one WARNING line, not a page of tracebacks
    celery_app.worker_main(argv)


def _supervised(child_args: list[str]) -> int:
    """`visbatch worker ARGS --no-supervise` in a child process, kept up (worker.drivers.fleet.supervisor)."""
    from worker.drivers.fleet.supervisor import Supervisor

    logging.getLogger("worker.drivers.fleet.supervisor").setLevel(logging.INFO)
    command = "from worker.cli.main import app; app(prog_name='visbatch')"
    return Supervisor([sys.executable, "-c", command, *child_args]).run()


def _check_hot_tier(rt: Any, threads: int | None) -> None:
    """Warn once at start when the cache Redis cannot hold this worker's pages in flight."""
    from ingest.token_rules import read_json_file
    from worker.planning.cache_check import A4_PAGE_PX, worker_hot_tier_warning
    from worker.planning.fleet_sizing import pages_in_flight_per_gpu

    log = logging.getLogger("worker.planning.cache_check")
    try:
        config = read_json_file(rt.model_name, "config.json", rt.settings.model_revision) or {}
        warning = worker_hot_tier_warning(
            rt.cache,
            config,
            rt.token_rule.count_visual_tokens(*A4_PAGE_PX),
            rt.adapter.dtype.itemsize,
            pages_in_flight_per_gpu(threads, rt.settings.encode_chunk_units),
        )
    except Exception as exc:  # a check: never the worker's end
        log.warning("hot-tier size not checked: %s: %s", type(exc).__name__, exc)
        return
    if warning:
        log.warning("%s", warning)


def _load_default_model() -> Any:
    """Load the default model before the first message is taken: a burst of messages then finds
    it ready instead of several task threads loading it at once, and a model that cannot load
    stops this worker (EX_CONFIG, the reason logged) instead of failing the units it holds."""
    from ingest.token_rules import ModelFilesUnavailable, UnsupportedModel
    from worker.drivers.fleet.supervisor import EX_CONFIG
    from worker.drivers.fleet.tasks import runtime_for
    from worker.runtime import ModelUnavailable

    log = logging.getLogger("worker.runtime")
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))
    try:
        rt = runtime_for(None)
        rt.load_model()
    except (ModelUnavailable, ModelFilesUnavailable, UnsupportedModel) as exc:
        log.critical("this worker takes no message: %s", exc)
        raise typer.Exit(EX_CONFIG) from None
    except Exception as exc:  # the database or the cache away: the tasks load the model later
        log.warning("model not loaded at start (%s: %s): the first task loads it", type(exc).__name__, exc)
    else:
        log.info("model %s loaded", rt.model_name)
        return rt
    return None


def _serve_worker_metrics(settings: Settings, port: int | None, *, prefork: bool) -> int | None:
    """Serve this worker's metrics on the port asked for or the next free one (several workers
    share a host); a metrics failure is a warning, never the worker's end. The port it serves on."""
    log = logging.getLogger("worker.metrics")
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))  # the "metrics on :PORT" line
    try:
        if prefork and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            # Tasks run in pool processes: their metrics are summed by the parent's endpoint. Set
            # before prometheus_client is first imported (it picks its value store on import).
            import tempfile

            os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="visbatch-metrics-")
        from worker import metrics
        from worker.drivers.fleet.celery_app import QUEUES
        from worker.drivers.fleet.consumers import queue_depths

        wanted = settings.metrics_port if port is None else port
        collectors = [
            metrics.job_states(settings.sqlalchemy_url()),
            metrics.QueueDepthCollector(lambda: queue_depths(settings, QUEUES)),
        ]
        server = metrics.serve(wanted, collectors=collectors, span=metrics.PORT_SPAN)
    except Exception as exc:
        log.warning("metrics off: %s: %s (the worker runs without them)", type(exc).__name__, exc)
        return None
    if port is not None and port != 0 and server.server_port != port:
        log.warning("--metrics-port %d is in use: metrics on :%d instead", port, server.server_port)
    return int(server.server_port)


@app.command()
def status(
    job: JobId, as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False
) -> None:
    """Show a job's state, counters and every error.

    Each error names the source, the page (from 1) or frame time, and the prompt it concerns."""
    # storage.jobs itself, not the repository facade: no claims, sources or units to import.
    from storage.jobs import job_summary
    from worker.drivers.job_activity import job_activity

    settings = Settings()
    summary = job_summary(stored_database(settings), job)
    # Stalled, waiting for a worker, or interrupted (its process is gone).
    summary["activity"] = job_activity(settings, summary)
    if as_json:
        # Plain print: machine-readable output must not be wrapped or styled.
        print(json.dumps(summary, default=str, indent=2))
    else:
        print_summary(out, summary)


@app.command()
def results(
    job: JobId,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="jsonl, csv or parquet (default: the -o FILE's extension, else jsonl).",
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="File (default: stdout); its extension, .jsonl .csv or .parquet, is the format.",
        ),
    ] = None,
    by_document: Annotated[
        Path | None,
        typer.Option(
            "--by-document",
            metavar="DIR",
            help="One file per source in DIR, pages in order: Markdown (text answers) or JSON "
            "(schema answers). DIR is this job's alone: another job's is refused.",
        ),
    ] = None,
) -> None:
    """Write a job's answers as JSON lines, CSV or Parquet.

    Every answer with its source, page number (from 1) or timestamp, and prompt text; jsonl and
    csv stream to stdout; -o FILE writes the format its extension names."""
    from storage.jobs import job_summary
    from storage.results import iter_results
    from worker.results_export import (
        asked,
        export_records,
        output_format,
        write_by_document,
        write_csv,
        write_file,
        write_jsonl,
    )

    fmt = output_format(output, fmt)
    if fmt == "parquet" and output is None and by_document is None:
        raise UserError("--format parquet writes a file", "add -o FILE (e.g. -o answers.parquet)")
    db = stored_database(Settings())
    summary = job_summary(db, job, max_errors=0)
    prompts = asked(summary["spec"])
    records = export_records(iter_results(db, summary["id"]), prompts, summary["spec"].get("then") or [])
    if by_document is not None:
        as_json = summary["spec"].get("json_schema") is not None
        written = write_by_document(records, by_document, prompts, as_json=as_json, job_id=summary["id"])
        kind = "JSON" if as_json else "Markdown"
        console.print(f"wrote {len(written)} {kind} file(s), one per source, to {by_document}")
        return
    if output is not None:
        count = write_file(records, output, fmt)
        console.print(f"wrote {count} answer(s) to {output} ({fmt})")
    else:
        (write_csv if fmt == "csv" else write_jsonl)(records, sys.stdout)
    for key, value in token_lines(summary.get("tokens")):  # stderr: the records stay clean on stdout
        console.print(f"{key}: {value}")


@app.command()
def jobs(
    limit: Annotated[int, typer.Option(metavar="N", min=1, help="How many, newest first.")] = 20,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON array, one object per job, newest first.")
    ] = False,
) -> None:
    """List recent jobs with their counts.

    Each job's status, when it was made, and how many sources, pages/frames, answers and
    errors it has."""
    from storage.jobs import list_jobs
    from worker.drivers.job_activity import shown_status

    db = stored_database(Settings())
    listed = []
    for item in list_jobs(db, limit=limit):
        errors = sum(int(item.get(key) or 0) for key in ("sources_failed", "units_failed", "results_failed"))
        answers = int(item.get("results_total") or 0) - int(item.get("results_failed") or 0)
        # `status` as shown (`interrupted` derived), the stored one beside it, and the table's counts.
        listed.append({**item, "status": shown_status(item), "stored_status": item["status"],
                       "answers": answers, "errors": errors})  # fmt: skip
    if as_json:
        print(json.dumps(listed, default=str, indent=2))  # plain print: no wrapping, no style
        return
    from rich.table import Table

    # No borders, nothing cut: fits 80 columns with a 12-digit id (any unique prefix works).
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name in ("id", "status", "created (UTC)", "sources", "pages", "answers", "errors"):
        table.add_column(
            name,
            no_wrap=True,
            justify="right" if name in ("sources", "pages", "answers", "errors") else "left",
        )
    for item in listed:
        created = str(item["created_at"] or "")[:16].replace("T", " ")
        table.add_row(
            item["id"][:12], item["status"], created, str(item.get("sources_total") or 0),
            str(item.get("units_total") or 0), str(item["answers"]), str(item["errors"]),
        )  # fmt: skip
    out.print(table)
    interrupted = [item["id"][:12] for item in listed if item["status"] == "interrupted"]
    if interrupted:  # stderr: the table stays what a script reads
        which = "the process that ran it is gone; continue it"
        if len(interrupted) > 1:
            which = f"{len(interrupted)} jobs whose process is gone; continue one"
        console.print(f"interrupted: {which}: visbatch resume {interrupted[0]}", highlight=False)


_register_review(app)
_register_purge(app)
_register_workers(app)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to write the model into.")],
    seed: Annotated[
        int,
        typer.Option(metavar="N", min=0, help="Seed of the random weights (the same seed, the same model)."),
    ] = 0,
    family: Annotated[
        str,
        typer.Option(
            metavar="FAMILY",
            help="qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3-vl-moe, idefics3, internvl or llava-onevision "
            "(or qwen3_vl, ...).",
        ),
    ] = "qwen2_vl",
) -> None:
    """Write a tiny random model, for tests and demos.

    A model of a supported family that loads offline, with RANDOM weights: its answers are
    meaningless."""
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
    """Make a model the default of the commands run here.

    Recorded in $VISBATCH_HOME/config.json; VISBATCH_MODEL and --model still win."""
    from visbatch.settings import write_home_config
    from worker.runtime import resolve_model_name

    folder = Path(model).expanduser()
    if (folder.exists() or model.startswith((".", "/", "~"))) and not (folder / "config.json").is_file():
        raise UserError(f"{model}: not a model folder (no config.json)", MODEL_FIX)
    settings = Settings()
    path = write_home_config(settings.home, model=resolve_model_name(model))
    console.print(f"default model: {resolve_model_name(model)} (recorded in {shown_path(str(path))})")


@model_app.command("show")
def model_show() -> None:
    """Show the model the commands use here, and why that one."""
    settings = Settings()
    origin = settings.model_origin
    print(settings.model)
    console.print(f"from {shown_path(origin) if origin not in ('default', 'VISBATCH_MODEL') else origin}")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the database migrations.

    To the SQLite file under $VISBATCH_HOME, or the database of VISBATCH_DATABASE_URL."""
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
