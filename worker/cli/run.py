"""The commands that start work: `run`, `resume`, `submit`, `ingest` and `plan`.

They live apart from worker.cli.main because their options are declared by the job spec (pydantic
models, worker.job_options, whose classes are built when imported): the command group imports
this module only when one of them is asked for (or for the full `visbatch --help`), so that
`status`, `jobs` and `results` do not pay for it. The shared pieces (the consoles, the runtime)
come from worker.cli.main.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from worker.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PARTIAL
from worker.cli.inputs import check_readable, chosen_files, unreadable_lines
from worker.cli.job_options import JobCommand, job_options
from worker.cli.main import JobId, console, make_runtime
from worker.cli.output import model_origin, print_preview, print_summary, progress_display
from worker.cli.plan import plan
from worker.errors import MODEL_FIX, Unavailable, UserError, first_line
from worker.job_options import JobOptions

app = typer.Typer(rich_markup_mode=None, pretty_exceptions_enable=False)

Paths = Annotated[
    list[Path], typer.Argument(metavar="PATH", help="Files or folders (walked).", show_default=False)
]


def _prepare_model(rt: Any, explicit: str | None, *, origin: str | None = None, weights: bool = True) -> None:
    """Say which model the command uses, and fail in seconds, with the fix, when it cannot be
    had: the token rule (its small JSON files) first, then the weights."""
    origin = origin or model_origin(rt.settings, explicit)
    console.print(f"model: {escape(rt.model_name)} (from {escape(origin)})")
    # Loading bars of the hub and transformers are noise in a log; the model line says what loads.
    # (Read when huggingface_hub is imported: before the token rule below imports it.)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    rt.token_rule  # noqa: B018 - ModelFilesUnavailable here is exit 4 with the fix (worker.errors)
    if not weights:
        return
    try:
        rt.adapter.count_visual_tokens(448, 448)
    except Exception as exc:
        raise Unavailable(f"cannot load model {rt.model_name!r}: {first_line(exc)}", MODEL_FIX) from exc


_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
_AGAIN = {signal.SIGINT: "press Ctrl-C again", signal.SIGTERM: "a second SIGTERM"}
_LAST_WRITE_S = 2.0  # a second signal waits at most this long for the job row to say cancelled


def _say(message: str) -> None:
    """One line on stderr from a signal handler: os.write, not the console, whose lock the
    interrupted code may hold. In a terminal the line starts afresh and the cursor that the
    progress bars hid comes back."""
    import sys

    prefix = "\r\x1b[2K\x1b[?25h" if sys.stderr.isatty() else "\n"
    with contextlib.suppress(OSError):
        os.write(2, (prefix + message + "\n").encode("utf-8", "replace"))


def _exit_now(run: Any, signum: int, ended: bool, *, second: bool) -> None:
    """A second signal (or one after the run ended): leave at once (exit 128+signal), but first say
    which job and how to continue it, and end the job `cancelled` if the database answers within
    _LAST_WRITE_S (else `status` and `jobs` tell it `interrupted`: its process is gone)."""
    import threading

    name = _SIGNAL_NAMES[signal.Signals(signum)]
    by = f"second {name}" if second else name
    job_id = run.job_id
    if job_id is None:
        _say(f"stopped at once ({by}): no job was created")
    elif ended and run.stop_reason is None:
        _say(f"stopped at once ({by}): job {job_id} has ended; see it: visbatch status {job_id}")
    else:
        state = "cancelled" if ended else "left unfinished"
        _say(
            f"stopped at once ({by}): job {job_id} {state}; finished work is kept. "
            f"Resume with: visbatch resume {job_id}"
        )
    if job_id is not None and not ended:

        def cancel() -> None:
            from storage.leases import end_held, release_lease

            with contextlib.suppress(Exception):
                reason = f"interrupted by a {by}, at once; finished work is kept"
                # Only while this run holds the job; let go, so a resume need not wait it out.
                end_held(run.rt.db, job_id, run.lease.holder, "cancelled", reason)
                release_lease(run.rt.db, job_id, run.lease.holder)

        writer = threading.Thread(target=cancel, name="last-write", daemon=True)
        writer.start()
        writer.join(_LAST_WRITE_S)
    os._exit(128 + signum)


class _Signals:
    """What the handler knows: the signals so far, and whether the run has ended (its summary is
    being printed)."""

    count = 0
    ended = False


@contextlib.contextmanager
def _stop_on_signals(run: Any) -> Iterator[_Signals]:
    """SIGINT and SIGTERM stop the run promptly (the job ends cancelled, its work kept); a second
    signal, during the stop or the summary after it, leaves at once, still naming the job and
    the resume command."""
    import threading

    previous = {sig: signal.getsignal(sig) for sig in _SIGNAL_NAMES}
    seen = _Signals()

    def handler(signum: int, _frame: Any) -> None:
        seen.count += 1
        if seen.count > 2:  # a third one while the second leaves
            os._exit(128 + signum)
        if seen.count == 2 or seen.ended:  # the run has ended: nothing left to stop gently
            _exit_now(run, signum, seen.ended, second=seen.count == 2)
        name = _SIGNAL_NAMES[signal.Signals(signum)]
        run.request_stop(f"interrupted by {name}")
        if run.job_id is not None:
            # From a thread: the progress display's lock may be held by the code interrupted here.
            note = (
                f"{name}: stopping job {run.job_id}, finished work is kept "
                f"({_AGAIN[signum]} to leave at once)"
            )
            threading.Thread(target=run.progress.note, args=(note,), name="stop-note", daemon=True).start()

    for sig in _SIGNAL_NAMES:
        signal.signal(sig, handler)
    try:
        yield seen
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _exit_for(status: str) -> None:
    if status != "succeeded":
        raise typer.Exit(EXIT_PARTIAL if status == "partial" else EXIT_FAILED)


def _results_hint(job_id: str) -> str:
    return (
        f"all answers: visbatch results {job_id}  (-o FILE.csv|.parquet|.jsonl, "
        f"--by-document DIR; status: visbatch status {job_id})"
    )


def _print_answers(rt: Any, job_id: str, summary: dict[str, Any]) -> None:
    """The first answers and the command for all of them; a job without one answer advertises
    none (its errors are in the summary above)."""
    from storage.jobs import preview_per_source

    if not summary.get("results"):
        console.print(f"no answers; every error: visbatch status {job_id}")
        return
    from worker.results_export import asked

    spec = summary["spec"]
    print_preview(console, asked(spec), spec.get("then") or [], preview_per_source(rt.db, job_id))
    console.print(_results_hint(job_id))


MetricsPort = Annotated[
    int | None,
    typer.Option(
        metavar="PORT",
        min=1,
        max=65535,
        help="Serve Prometheus metrics of this run on PORT (off by default).",
    ),
]


def _run_embedded(rt: Any, start: Any, metrics_port: int | None = None) -> None:
    """Run (or resume) a job in this process with progress; print its id on stdout before any
    work starts, its summary, first answers and the results command on stderr at the end; exit
    with the job's status code."""
    from storage import repository as repo
    from worker.drivers.embedded import EmbeddedRun

    job: dict[str, str] = {}

    def on_job(job_id: str) -> None:
        job["id"] = job_id
        print(job_id, flush=True)  # stdout: a script can always resume or inspect it
        console.print(f"job {job_id} started")

    embedded = EmbeddedRun(rt)
    # The signal handlers last until the summary is out: a second Ctrl-C there still names the job.
    with _stop_on_signals(embedded) as signals:
        with progress_display(console) as progress:
            embedded.progress = progress
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
            start(embedded, on_job)
        signals.ended = True
        summary = repo.job_summary(rt.db, job["id"])
        print_summary(console, summary)
        done = embedded.work_done()
        console.print(
            f"this run: {done['split']} pages/frames split, {done['tower_images']} images through the "
            f"vision tower, {done['answers']} answers generated"
        )
        if embedded.lease.lost:  # another run holds the job now: it goes on there, not cancelled
            console.print(
                f"stopped: {escape(embedded.stop_reason or 'the job was taken over')} (this run paused "
                f"longer than its lease); it continues there: visbatch status {job['id']}"
            )
            raise typer.Exit(EXIT_INTERRUPTED)
        if embedded.stop_reason is not None:
            console.print(
                f"stopped: job {job['id']} cancelled ({escape(embedded.stop_reason)}); finished work is "
                f"kept. Resume with: visbatch resume {job['id']}"
            )
            raise typer.Exit(EXIT_INTERRUPTED)
        _print_answers(rt, job["id"], summary)
        _exit_for(summary["status"])


@app.command(cls=JobCommand)
@job_options()
def run(paths: Paths, job: JobOptions, metrics_port: MetricsPort = None) -> None:
    """Run a job in this process and wait for its answers.

    Prints the job id on stdout first; progress, the summary and the first answers go to stderr.
    Exit 0 when every page/frame was answered, 1 partial, 2 bad input, 3 failed, 4 model or
    database unavailable, 130 interrupted."""
    spec = job.spec()
    files = chosen_files(paths, job)
    # Named at once, not in the summary after the model's load and the run: the job goes on
    # with the others (docs/cli.md), these become its failed sources.
    for line in unreadable_lines(check_readable(files), len(files)):
        console.print(escape(line), highlight=False)
    rt = make_runtime(job.model)
    rt.db  # noqa: B018 - the database reachable and migrated before the model's seconds of loading
    _prepare_model(rt, job.model)
    _run_embedded(rt, lambda embedded, on_job: embedded.run(files, spec, on_job), metrics_port)


@app.command()
def resume(job: JobId, metrics_port: MetricsPort = None) -> None:
    """Continue a stopped job in place; nothing is done twice.

    A cancelled, interrupted, failed or partial job: no page rendered or image encoded twice,
    only the missing answers generated. A job whose run is still alive (in another terminal,
    container or host: its lease is live) is refused, exit 2."""
    from storage import repository as repo
    from storage.db import Database
    from visbatch.settings import Settings

    # A job to resume is in a database that exists: in a folder without one, exit 4 naming where
    # it looked, and nothing created. One of an older visbatch is migrated (resume writes).
    found = Database(Settings().sqlalchemy_url(), create=False)
    if found.current_revision() is None:
        found.require_schema()  # no visbatch tables: DatabaseNotReady, exit 4
    found.dispose()
    rt = make_runtime(None)
    full_id = repo.resolve_job_id(rt.db, job)
    state = repo.job_state(rt.db, full_id)
    assert state is not None
    if state[0] == "succeeded":
        raise UserError(
            f"job {full_id} succeeded: nothing to resume", f"its answers: visbatch results {full_id}"
        )
    from storage.leases import read_lease
    from worker.drivers.run_lease import refuse_if_alive

    lease = read_lease(rt.db, full_id)
    if lease.holder is not None:
        refuse_if_alive(lease)  # at once, before the model's seconds of loading; touches nothing
    model = state[1].get("model")
    rt = make_runtime(model)
    # The model is the job's own (its spec), else this folder's choice: never "--model", which
    # `resume` does not take.
    _prepare_model(rt, None, origin="the job's spec" if model else None)
    _run_embedded(rt, lambda embedded, on_job: embedded.resume(full_id, on_job), metrics_port)


@app.command(cls=JobCommand)
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
    """Send a job to the fleet (Celery workers) and print its id.

    Local files are uploaded to the object store. The broker is checked first: when it cannot
    be reached, no job is made (exit 4)."""
    from worker.drivers.fleet.submit import missing_workers_warning, submit_job

    spec = job.spec()
    local = [Path(item) for item in inputs if not item.startswith("s3://")]
    files = [str(path) for path in chosen_files(local, job)] if local else []
    remote = [item for item in inputs if item.startswith("s3://")]
    rt = make_runtime(job.model)
    rt.db  # noqa: B018 - the database reachable and migrated (and said where, when made) first
    _check_broker()
    job_id = submit_job(rt, files + remote, spec)
    print(job_id, flush=True)
    warning = missing_workers_warning(rt.settings)
    if warning:
        console.print(escape(warning), highlight=False)
    if wait:
        _wait(rt, job_id)
    else:
        console.print(f"follow it: visbatch status {job_id}; answers: visbatch results {job_id}")


BROKER_CHECK_S = 3.0


def _check_broker() -> None:
    """Reach the broker before the job is made, through the Celery app's own connection (its URL
    and transport): one that is down is exit 4 with nothing made, not a `failed` job whose id was
    never printed (submit_job enqueues after it has written the job's rows)."""
    from worker.drivers.fleet.tasks import ingest_source
    from worker.errors import explain

    try:
        with ingest_source.app.connection_for_write() as connection:
            connection.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0, interval_max=0, timeout=BROKER_CHECK_S
            )
    except Exception as exc:
        error = explain(exc)  # kombu's: "cannot reach the broker URL: ...", exit 4
        if error is None:
            raise
        fix = f"{error.fix}; no job was made: submit again then"
        raise type(error)(error.message, fix) from exc


def _wait(rt: Any, job_id: str) -> None:
    from worker.drivers.fleet.submit import wait_for_job

    with progress_display(console) as progress:

        def show(s: dict) -> None:
            prompts = len(s["spec"]["prompts"])
            done = s["units_total"] - s.get("units_pending", 0)
            progress.update("units", max(0, done), s["units_total"] or None)
            # A windowed job's answers are per window: their number is known once all is split.
            total = None if s["spec"].get("window") else (s["units_total"] * prompts) or None
            progress.update("generate", s["results"] + s["results_failed"], total)

        summary = wait_for_job(rt, job_id, show)
    print_summary(console, summary)
    _print_answers(rt, job_id, summary)
    _exit_for(summary["status"])


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
    """Split sources into page and frame images, with no model.

    The ingest stage alone: PNGs and a manifest.jsonl. No GPU, no weights; visual-token counts
    when a model is named (--model or VISBATCH_MODEL).

    Exit 0 when every source and unit was written, 1 when some failed, 3 when none was, 2 for a
    usage error, 130 when interrupted (--out is then left as it was)."""
    from worker.cli.ingest import run_ingest

    options = job.ingest()  # a refused value is named before any input is looked at, as in `run`
    files = chosen_files(paths, job)
    run_ingest(files, out_dir, job.model, options, processes=processes, overwrite=overwrite)


app.command("plan", cls=JobCommand)(plan)
