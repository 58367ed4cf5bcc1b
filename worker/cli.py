"""The `visbatch` command."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ingest.spec import IngestOptions, JobSpec, Sampling
from storage.settings import Settings
from worker.budget_options import (
    Detail,
    MaxPixels,
    MaxTokensPerFrame,
    MaxTokensPerVideo,
    MinPixels,
    PruneKeep,
    RedundancyThreshold,
    SkipFrames,
    token_lines,
    visual_budget,
)

app = typer.Typer(
    help="Run vision-language models over piles of PDFs, videos and images.", no_args_is_help=True
)
model_app = typer.Typer(help="Model helpers.", no_args_is_help=True)
db_app = typer.Typer(help="Database helpers.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(db_app, name="db")

console = Console(stderr=True)
out = Console()

EXIT_PARTIAL = 1
EXIT_FAILED = 3

OFFLINE_HINT = (
    "If the model hub is unreachable, build the tiny offline model and use it:\n"
    "  visbatch model tiny ./tiny-model && export VISBATCH_MODEL=./tiny-model"
)

Paths = Annotated[list[Path], typer.Argument(help="Files or folders (walked).", show_default=False)]
LongestSide = Annotated[int | None, typer.Option(help="PDF render: longest side in px.")]
Dpi = Annotated[int | None, typer.Option(help="PDF render at this DPI instead of a longest side.")]
Pages = Annotated[str | None, typer.Option(help="PDF pages, 1-based ranges: '1-3,7'.")]
Fps = Annotated[float | None, typer.Option(help="Video: frames per second to sample.")]
NumFrames = Annotated[int | None, typer.Option(help="Video: N frames spread uniformly (instead of --fps).")]
MaxFrames = Annotated[
    int,
    typer.Option(
        help="Video: at most this many frames per video (64 by default); when --fps would take "
        "more, this many are spread over the whole video."
    ),
]
Keyframes = Annotated[
    bool,
    typer.Option(
        "--keyframes",
        help="Video: take the keyframe nearest to each sample when samples are sparser than "
        "keyframes (near-flat cost on long videos; timestamps are the keyframes').",
    ),
]
ModelOpt = Annotated[str | None, typer.Option(help="Hub id or local folder (default: $VISBATCH_MODEL).")]


def _ingest_options(longest_side, dpi, pages, fps, num_frames, max_frames, keyframes=False) -> IngestOptions:
    opts: dict[str, Any] = {
        "max_frames": max_frames, "pages": pages, "num_frames": num_frames, "keyframes": keyframes,
    }  # fmt: skip
    if dpi is not None:
        opts.update(dpi=dpi, longest_side=None)
    elif longest_side is not None:
        opts["longest_side"] = longest_side
    if fps is not None:
        opts["fps"] = fps
    return IngestOptions(**opts)


def _budget(*options):
    """The job's visual-token budget from the CLI options (see worker.budget_options)."""
    try:
        return visual_budget(*options)
    except ValueError as exc:
        _fail(f"visual-token budget: {exc}")
        raise  # unreachable


def _job_spec(prompts, schema, max_new_tokens, temperature, top_p, seed, ingest, budget=None) -> JobSpec:
    from worker.structured import SchemaError, check_schema

    json_schema = None
    if schema is not None:
        try:
            json_schema = json.loads(schema.read_text())
            check_schema(json_schema)
        except (OSError, json.JSONDecodeError, SchemaError) as exc:
            _fail(f"--schema {schema}: {exc}")
    try:
        return JobSpec(
            prompts=prompts,
            json_schema=json_schema,
            sampling=Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed),
            ingest=ingest,
            **({"budget": budget} if budget is not None else {}),
        )
    except ValueError as exc:
        _fail(str(exc))
        raise  # unreachable


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def _runtime(model: str | None):
    from worker.runtime import Runtime

    return Runtime(Settings(), model=model)


def _load_adapter(rt) -> None:
    try:
        rt.adapter.visual_tokens(448, 448)
    except Exception as exc:
        _fail(f"cannot load model {rt.model_name!r}: {exc}\n{OFFLINE_HINT}")


class RichProgress:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def start(self, stage: str, total: int | None) -> None:
        self.tasks[stage] = self.progress.add_task(stage, total=total)

    def advance(self, stage: str, n: int = 1) -> None:
        self.progress.advance(self.tasks[stage], n)

    def note(self, message: str) -> None:
        self.progress.console.print(message)


@app.command()
def run(
    paths: Paths,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A question for every page/frame.")],
    schema: Annotated[
        Path | None, typer.Option(help="JSON schema file: outputs are constrained to it.")
    ] = None,
    model: ModelOpt = None,
    longest_side: LongestSide = 1288,
    dpi: Dpi = None,
    pages: Pages = None,
    fps: Fps = None,
    num_frames: NumFrames = None,
    max_frames: MaxFrames = 64,
    keyframes: Keyframes = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated at most per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    detail: Detail = None,
    min_pixels: MinPixels = None,
    max_pixels: MaxPixels = None,
    max_tokens_per_frame: MaxTokensPerFrame = None,
    max_tokens_per_video: MaxTokensPerVideo = None,
    skip_redundant_frames: SkipFrames = True,
    redundancy_threshold: RedundancyThreshold = 3.0,
    prune_keep: PruneKeep = 1.0,
) -> None:
    """Run a job in this process (embedded shape) and print its id. Exit 0 only if every unit succeeded."""
    from worker.pipeline import run_job

    spec = _job_spec(
        prompt,
        schema,
        max_new_tokens,
        temperature,
        top_p,
        seed,
        _ingest_options(longest_side, dpi, pages, fps, num_frames, max_frames, keyframes),
        _budget(
            detail,
            min_pixels,
            max_pixels,
            max_tokens_per_frame,
            max_tokens_per_video,
            skip_redundant_frames,
            redundancy_threshold,
            prune_keep,
        ),  # fmt: skip
    )
    rt = _runtime(model)
    _load_adapter(rt)
    columns = [TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bars:
        job_id = run_job(rt, paths, spec, RichProgress(bars))
    from storage import repository as repo

    summary = repo.job_summary(rt.db, job_id)
    _print_summary(summary)
    out.print(job_id)
    if summary["status"] != "succeeded":
        raise typer.Exit(EXIT_PARTIAL if summary["status"] == "partial" else EXIT_FAILED)


@app.command()
def submit(
    inputs: Annotated[
        list[str], typer.Argument(help="Files, folders, s3://bucket/key or s3://bucket/prefix/.")
    ],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A question for every page/frame.")],
    schema: Annotated[
        Path | None, typer.Option(help="JSON schema file: outputs are constrained to it.")
    ] = None,
    model: ModelOpt = None,
    longest_side: LongestSide = 1288,
    dpi: Dpi = None,
    pages: Pages = None,
    fps: Fps = None,
    num_frames: NumFrames = None,
    max_frames: MaxFrames = 64,
    keyframes: Keyframes = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated at most per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    detail: Detail = None,
    min_pixels: MinPixels = None,
    max_pixels: MaxPixels = None,
    max_tokens_per_frame: MaxTokensPerFrame = None,
    max_tokens_per_video: MaxTokensPerVideo = None,
    skip_redundant_frames: SkipFrames = True,
    redundancy_threshold: RedundancyThreshold = 3.0,
    prune_keep: PruneKeep = 1.0,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress until the job ends.")] = False,
) -> None:
    """Send a job to the fleet (Celery workers); prints its id. Local files are uploaded to the store."""
    from worker.submit import submit_job

    spec = _job_spec(
        prompt,
        schema,
        max_new_tokens,
        temperature,
        top_p,
        seed,
        _ingest_options(longest_side, dpi, pages, fps, num_frames, max_frames, keyframes),
        _budget(
            detail,
            min_pixels,
            max_pixels,
            max_tokens_per_frame,
            max_tokens_per_video,
            skip_redundant_frames,
            redundancy_threshold,
            prune_keep,
        ),  # fmt: skip
    )
    rt = _runtime(model)
    job_id = submit_job(rt, inputs, spec)
    out.print(job_id)
    if wait:
        _wait(rt, job_id)


def _wait(rt, job_id: str) -> None:
    from worker.submit import wait_for_job

    columns = [TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as bars:
        units = bars.add_task("units", total=None)
        answers = bars.add_task("answers", total=None)

        def show(s: dict) -> None:
            prompts = len(s["spec"]["prompts"])
            done = s["units_total"] - s.get("units_pending", 0)
            bars.update(units, total=s["units_total"] or None, completed=max(0, done))
            bars.update(
                answers,
                total=(s["units_total"] * prompts) or None,
                completed=s["results"] + s["results_failed"],
            )

        summary = wait_for_job(rt, job_id, show)
    _print_summary(summary)
    if summary["status"] != "succeeded":
        raise typer.Exit(EXIT_PARTIAL if summary["status"] == "partial" else EXIT_FAILED)


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
) -> None:
    """Turn each object dropped under an S3 prefix into one fleet job, exactly once (a _spec.json
    beside the objects may give their prompts and schema)."""
    import signal
    import threading

    from ingest.dropfolder import DropFolderWatcher
    from worker.submit import submit_job

    default = None
    if spec_file is not None:
        try:
            default = JobSpec.model_validate_json(spec_file.read_text())
        except (OSError, ValueError) as exc:
            _fail(f"--spec {spec_file}: {exc}")
    elif prompt:
        default = JobSpec(prompts=prompt)
    rt = _runtime(None)
    watcher = DropFolderWatcher.from_url(
        prefix,
        rt.db,
        lambda uris, spec: submit_job(rt, uris, spec),
        default_spec=default,
        done_prefix=done_prefix or None,
        failed_prefix=failed_prefix or None,
        poll_seconds=poll_seconds,
        endpoint_url=rt.settings.s3_endpoint_url,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        watcher.run(stop)
    except KeyboardInterrupt:
        stop.set()


@app.command()
def cancel(job: str) -> None:
    """Stop a fleet job's remaining work; what is done stays."""
    from storage import repository as repo
    from worker.submit import cancel_job

    rt = _runtime(None)
    try:
        job_id = cancel_job(rt, job)
    except repo.JobNotFound as exc:
        _fail(str(exc))
    console.print(f"job {job_id}: {repo.job_summary(rt.db, job_id)['status']}")


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option(help="Comma-separated: ingest, encode, generate.")
    ] = "ingest,encode,generate",
    concurrency: Annotated[int, typer.Option(help="Processes for the ingest (CPU) pool.")] = 1,
    name: Annotated[str | None, typer.Option(help="Worker name (default: from the queues and host).")] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Start a Celery worker: prefork for ingest alone, solo (model loaded once) for GPU stages."""
    from worker.celery_app import QUEUES
    from worker.celery_app import app as celery_app

    chosen = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(chosen) - set(QUEUES))
    if unknown or not chosen:
        _fail(f"unknown queue(s) {unknown}; choose from {', '.join(QUEUES)}")
    settings = Settings()
    gpu = bool({"encode", "generate"} & set(chosen))
    # The generate worker must hold a batch's worth of messages to pack them (celery-batches);
    # every other worker takes one task at a time so no task waits behind a long one.
    prefetch = settings.generate_flush_every + 1 if "generate" in chosen else 1
    argv = [
        "worker",
        "-Q",
        ",".join(chosen),
        "--loglevel",
        loglevel,
        "--prefetch-multiplier",
        str(prefetch),
        "-n",
        name or f"visbatch-{'-'.join(chosen)}-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
    if gpu:
        if concurrency != 1:
            console.print("GPU stages run one process per worker (solo pool): start one worker per GPU.")
        argv += ["-P", "solo"]
    else:
        # Recycle ingest processes now and then: PDF and video libraries can hold on to memory.
        argv += ["-P", "prefork", "-c", str(concurrency), "--max-tasks-per-child", "200"]
    celery_app.worker_main(argv)


@app.command()
def ingest(
    paths: Paths,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Folder for the images and manifest.jsonl (must be empty or new).")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            help="Hub id or local folder: adds visual-token counts (default: $VISBATCH_MODEL if set)."
        ),
    ] = None,
    longest_side: LongestSide = 1288,
    dpi: Dpi = None,
    pages: Pages = None,
    fps: Fps = None,
    num_frames: NumFrames = None,
    max_frames: MaxFrames = 64,
    keyframes: Keyframes = False,
    processes: Annotated[
        int | None, typer.Option(min=1, help="Processes rendering a PDF's pages (default: the CPU cores).")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace --out if it holds an ingest.")
    ] = False,
) -> None:
    """Split sources into page and frame images (PNG) and a manifest; no GPU, no model weights.

    Exit 0 when every source and unit was written, 1 when some failed, 3 when none was, 2 for a
    usage error, 130 when interrupted (--out is then left as it was).
    """
    from worker.ingest_cli import run_ingest

    options = _ingest_options(longest_side, dpi, pages, fps, num_frames, max_frames, keyframes)
    run_ingest(paths, out_dir, model, options, processes=processes, overwrite=overwrite)


def _print_summary(s: dict[str, Any]) -> None:
    table = Table(title=f"job {s['id']}", show_header=False, min_width=40)
    for key in (
        "status",
        "sources_total",
        "sources_failed",
        "units_total",
        "units_failed",
        "results",
        "results_failed",
        "cache_hits",
        "cache_misses",
        "visual_tokens",
        "prompt_tokens",
        "completion_tokens",
    ):
        table.add_row(key, str(s.get(key)))
    for key, value in token_lines(s.get("tokens")):
        table.add_row(key, value)
    console.print(table)
    for err in s.get("errors", [])[:20]:
        where = err["source"] + (f" #{err['unit']}" if err.get("unit") is not None else "")
        console.print(f"  [red]{where}[/]: {err['message']}")
    if len(s.get("errors", [])) > 20:
        console.print(f"  ... {len(s['errors']) - 20} more errors (visbatch status {s['id']} --json)")


def _summary_or_exit(job: str) -> tuple[Any, dict[str, Any]]:
    from storage import repository as repo

    rt = _runtime(None)
    try:
        return rt, repo.job_summary(rt.db, job)
    except repo.JobNotFound as exc:
        _fail(str(exc))
        raise  # unreachable; keeps type checkers calm


@app.command()
def status(
    job: str, as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False
) -> None:
    """A job's state, counters and errors."""
    _, summary = _summary_or_exit(job)
    if as_json:
        # Plain print: machine-readable output must not be wrapped or styled.
        print(json.dumps(summary, default=str, indent=2))
    else:
        _print_summary(summary)


RESULT_FIELDS = [
    "source",
    "kind",
    "unit",
    "timestamp",
    "prompt_index",
    "output",
    "text",
    "error",
    "prompt_tokens",
    "visual_tokens",
    "completion_tokens",
    "finish_reason",
    "model",
    "engine",
    "cache_hit",
    "latency_ms",
    "pruned_tokens",
]


@app.command()
def results(
    job: str,
    fmt: Annotated[str, typer.Option("--format", help="jsonl or csv.")] = "jsonl",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File (default: stdout).")] = None,
) -> None:
    """One record per result: source, unit, timestamp, prompt, output, token counts."""
    from storage import repository as repo

    if fmt not in ("jsonl", "csv"):
        _fail("--format must be jsonl or csv")
    rt, summary = _summary_or_exit(job)
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(open(output, "w", newline="")) if output else sys.stdout
        writer = csv.DictWriter(handle, RESULT_FIELDS, extrasaction="ignore") if fmt == "csv" else None
        if writer:
            writer.writeheader()
        for record in repo.iter_results(rt.db, summary["id"]):
            if writer:
                output_json = None if record["output"] is None else json.dumps(record["output"])
                writer.writerow(dict(record, output=output_json))
            else:
                handle.write(json.dumps({k: record.get(k) for k in RESULT_FIELDS}, default=str) + "\n")
    for key, value in token_lines(summary.get("tokens")):  # stderr: the records stay clean on stdout
        console.print(f"{key}: {value}")


@app.command()
def jobs(limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20) -> None:
    """Recent jobs."""
    from storage import repository as repo

    rt = _runtime(None)
    table = Table("status", "created", "units", "failed")
    table.add_column("id", no_wrap=True)
    for job in repo.list_jobs(rt.db, limit=limit):
        created = str(job["created_at"])[:19]
        units, failed = str(job.get("units_total")), str(job.get("units_failed"))
        table.add_row(job["status"], created, units, failed, job["id"])
    out.print(table)


def _register_plan() -> None:
    from worker.plan_cli import plan

    app.command("plan")(plan)


_register_plan()


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    seed: Annotated[int, typer.Option()] = 0,
    family: Annotated[str, typer.Option(help="qwen2_vl or qwen2_5_vl.")] = "qwen2_vl",
) -> None:
    """Write a tiny RANDOM Qwen2-VL that loads offline (for tests and demos; its outputs are meaningless)."""
    from worker.models.tiny import write_tiny_model

    write_tiny_model(out_dir, family=family, seed=seed)
    console.print(f"wrote a tiny random Qwen2-VL to {out_dir} (random weights: outputs are meaningless)")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the database migrations (SQLite or PostgreSQL from VISBATCH_DATABASE_URL)."""
    from storage.db import Database

    db = Database(Settings().sqlalchemy_url())
    db.upgrade()
    console.print("database is at the latest migration")


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
