"""The `visbatch` command."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
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
    MergeKeep,
    MinPixels,
    PruneKeep,
    RedundancyThreshold,
    SkipFrames,
    token_lines,
    visual_budget,
)
from worker.review.cli import register as _register_review

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
EXIT_INTERRUPTED = 130

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
    # The same checks and messages as a drop folder's _spec.json and JobSpec(...) in Python:
    # JobSpec validates its schema itself (ingest.spec, ingest.schema).
    from pydantic import ValidationError

    from ingest.spec import SpecError, describe_spec_error, schema_from_json

    json_schema = None
    if schema is not None:
        try:
            json_schema = schema_from_json(schema.read_bytes())
        except (OSError, SpecError) as exc:
            _fail(f"--schema {schema}: {exc}")
    try:
        return JobSpec(
            prompts=prompts,
            json_schema=json_schema,
            sampling=Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed),
            ingest=ingest,
            **({"budget": budget} if budget is not None else {}),
        )
    except ValidationError as exc:
        _fail(f"invalid job spec: {describe_spec_error(exc)}")
        raise  # unreachable
    except ValueError as exc:
        _fail(str(exc))
        raise  # unreachable


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # Escaped: messages quote user input (schemas, keys) whose brackets rich would take for markup.
    # soft_wrap: one line per message, whatever the terminal's width (logs are grepped).
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
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
    """Progress bars on stderr: sources, then units as each stage gets through them (totals grow)."""

    LABELS = {"sources": "sources", "units": "pages+frames", "encode": "encoded", "generate": "answered"}

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def update(self, stage: str, done: int, total: int | None = None) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(self.LABELS.get(stage, stage), total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)

    def note(self, message: str) -> None:
        self.progress.console.print(message)


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


MetricsPort = Annotated[
    int | None, typer.Option(help="Serve Prometheus metrics of this run on this port (off by default).")
]


def _run_embedded(rt: Any, start: Any, metrics_port: int | None = None) -> None:
    """Run (or resume) a job in this process with progress bars; print its id on stdout before any
    work starts, its summary on stderr at the end; exit with the job's status code."""
    from storage import repository as repo
    from worker.embedded import EmbeddedRun

    columns = [TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    job: dict[str, str] = {}

    def on_job(job_id: str) -> None:
        job["id"] = job_id
        print(job_id, flush=True)  # stdout: a script can always resume or inspect it

    with Progress(*columns, console=console) as bars:
        embedded = EmbeddedRun(rt, RichProgress(bars))
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
    _print_summary(summary)
    done = embedded.work_done()
    console.print(
        f"this run: {done['split']} pages/frames split, {done['tower_images']} images through the "
        f"vision tower, {done['answers']} answers generated",
        soft_wrap=True,
        highlight=False,
    )
    if embedded.stop_reason is not None:
        console.print(
            f"stopped: job {job['id']} cancelled ({embedded.stop_reason}); finished work is kept. "
            f"Resume with: visbatch resume {job['id']}",
            soft_wrap=True,  # one line, also in a log file
            highlight=False,
        )
        raise typer.Exit(EXIT_INTERRUPTED)
    if summary["status"] != "succeeded":
        raise typer.Exit(EXIT_PARTIAL if summary["status"] == "partial" else EXIT_FAILED)


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
    merge_keep: MergeKeep = 1.0,
    metrics_port: MetricsPort = None,
) -> None:
    """Run a job in this process (embedded shape); its id is printed first. Exit 0 only if every unit
    succeeded."""
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
            merge_keep,
        ),  # fmt: skip
    )
    rt = _runtime(model)
    _load_adapter(rt)
    _run_embedded(rt, lambda embedded, on_job: embedded.run(paths, spec, on_job), metrics_port)


@app.command()
def resume(job: str, metrics_port: MetricsPort = None) -> None:
    """Continue a stopped job (cancelled, interrupted or failed) in place: no page rendered or image
    encoded twice, only the missing answers generated."""
    from storage import repository as repo

    rt = _runtime(None)
    try:
        full_id = repo.resolve_job_id(rt.db, job)
    except repo.JobNotFound as exc:
        _fail(str(exc))
        raise
    state = repo.job_state(rt.db, full_id)
    assert state is not None
    if state[0] == "succeeded":
        _fail(f"job {full_id} succeeded: nothing to resume")
    rt = _runtime(state[1].get("model"))
    _load_adapter(rt)
    _run_embedded(rt, lambda embedded, on_job: embedded.resume(full_id, on_job), metrics_port)


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
    merge_keep: MergeKeep = 1.0,
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
            merge_keep,
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
        _fail(f"--log-level {log_level}: use DEBUG, INFO, WARNING or ERROR")
    # A daemon's log is its only voice: the watcher's own lines at INFO by default, whatever the
    # other commands' quieter default (libraries stay at the root level; --verbose wins).
    if logging.getLogger().level != logging.DEBUG:
        logging.getLogger("ingest").setLevel(level)
    default = None
    if spec_file is not None:
        try:
            default = spec_from_json(spec_file.read_bytes())
        except (OSError, SpecError) as exc:
            _fail(f"--spec {spec_file}: {exc}")
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
        _fail(str(exc))
        raise  # unreachable
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        watcher.run(stop)
    except WatcherRefused as exc:
        _fail(str(exc))
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
        typer.Option(help="Serve Prometheus metrics on this port (default: $VISBATCH_METRICS_PORT, 9808)."),
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
        _fail(f"unknown queue(s) {unknown}; choose from {', '.join(QUEUES)}")
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
    for key, value in timing_lines(s.get("timing")):
        table.add_row(key, value)
    console.print(table)
    for err in s.get("errors", [])[:20]:
        where = err["source"] + (f" #{err['unit']}" if err.get("unit") is not None else "")
        console.print(f"  [red]{where}[/]: {err['message']}")
    if len(s.get("errors", [])) > 20:
        console.print(f"  ... {len(s['errors']) - 20} more errors (visbatch status {s['id']} --json)")


def timing_lines(timing: dict | None) -> list[tuple[str, str]]:
    """Wall time, time to the first result, each stage's busy time, pages (units) per second."""
    if not timing or timing.get("wall_seconds") is None:
        return []
    busy = timing["busy_seconds"]
    lines = [("wall time", f"{timing['wall_seconds']:.1f} s")]
    if timing.get("first_result_seconds") is not None:
        lines.append(("first result after", f"{timing['first_result_seconds']:.1f} s"))
    lines.append(("busy", ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in busy.items())))
    if timing.get("units_per_second"):
        lines.append(("pages+frames per second", f"{timing['units_per_second']:.2f}"))
    if timing.get("eta_seconds") is not None:
        lines.append(("rate, time left", f"{timing['rate_units_per_second']:.2f} pages+frames/s, "
                      f"about {timing['eta_seconds']:.0f} s at that rate"))  # fmt: skip
    return lines


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
    "merged_tokens",
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
_register_review(app)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the model into.")],
    seed: Annotated[int, typer.Option()] = 0,
    family: Annotated[
        str, typer.Option(help="qwen2-vl, qwen2.5-vl, qwen3-vl, qwen3-vl-moe or idefics3 (or qwen3_vl, ...).")
    ] = "qwen2_vl",
) -> None:
    """Write a tiny RANDOM model of a supported family that loads offline (for tests and demos; its
    outputs are meaningless)."""
    from worker.models.tiny import normalize_family, write_tiny_model

    try:
        family = normalize_family(family)
    except ValueError as exc:
        _fail(str(exc))
    write_tiny_model(out_dir, family=family, seed=seed)
    console.print(f"wrote a tiny random {family} to {out_dir} (random weights: outputs are meaningless)")


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
