"""The Python API's code (re-exported by the ``visbatch`` package, whose docstring shows its use).

The same code as the command line: the job's options are the CLI's (worker.job_options, as
keyword arguments: ``longest_side=``, ``fps=``, ``detail=``, ``max_new_tokens=`` ...), the run is
worker.drivers.embedded.EmbeddedRun, submission worker.drivers.fleet.submit, and the answers come from
storage.repository in the records of `visbatch results` (worker.results_export): ``source``,
``kind``, ``page_number`` (PDF pages from 1), ``timestamp`` (video), ``unit_index`` and
``prompt_index`` (from 0, as in SQL), ``prompt``, ``output`` (JSON answers), ``text``, ``error``,
token counts. Settings (database, store, cache, model) come from ``VISBATCH_*`` as everywhere.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from worker.errors import Unavailable, UserError, explain

if TYPE_CHECKING:
    from worker.runtime import Runtime

__all__ = ["Error", "Job", "NoWorkerWarning", "Unavailable", "job", "jobs", "run", "submit"]

# The one exception type of the package: a problem a caller can fix or meet (bad option, no input
# files, an unwritable path, a database URL typo), with ``message`` and ``fix``, the CLI's words.
# Its subclass Unavailable: the database, broker, store or model cannot be reached or found.
Error = UserError

F = TypeVar("F", bound=Callable[..., Any])


def _as_error(exc: Exception) -> UserError | None:
    error = explain(exc)
    if error is None or error is exc:
        return error
    kind = Unavailable if isinstance(error, Unavailable) else UserError
    plain = kind(error.message, error.fix)
    plain.original = exc  # type: ignore[attr-defined] - the driver's error, for whoever digs
    return plain


def _plain_errors(function: F) -> F:
    """What the command would say in two lines is raised as visbatch.Error (or Unavailable), not
    a page of SQLAlchemy frames; a bug stays the exception it is. A generator's errors come while
    it is iterated: they are translated there."""

    if inspect.isgeneratorfunction(function):

        @functools.wraps(function)
        def generator(*args: Any, **kwargs: Any) -> Any:
            try:
                yield from function(*args, **kwargs)
            except Exception as exc:
                error = _as_error(exc)
                if error is None or error is exc:
                    raise
                raise error from None

        return generator  # type: ignore[return-value]

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            error = _as_error(exc)
            if error is None or error is exc:
                raise
            raise error from None

    return wrapper  # type: ignore[return-value]


PathLike = str | Path


def _options(prompts: Sequence[str], schema: Any, model: str | None, options: dict[str, Any]) -> Any:
    """The CLI's job options (defaults from their one declaration) with these values."""
    from worker.job_options import JOB_GROUPS, JobOptions, options_of

    declared = {opt.name for opt in options_of(JOB_GROUPS)} - {"prompt", "schema", "model"}
    unknown = sorted(set(options) - declared)
    if unknown:
        allowed = ", ".join(sorted(declared))
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the job options are: {allowed}")
    # A schema is a dict, or the path of its file (read and checked like --schema).
    return JobOptions.with_defaults({**options, "prompt": list(prompts), "model": model, "schema": schema})


def _spec(job_options: Any) -> Any:
    if not job_options.prompts:
        raise UserError("no prompt given", "pass prompts=['What is on this page?']")
    return job_options.spec()


def _runtime(model: str | None, *, existing_db: bool = False) -> Runtime:
    """``existing_db``: for a call that only reads (or changes) stored jobs, as `visbatch status`:
    the database must be there already; none is made in the current folder (visbatch.Unavailable
    naming where it looked)."""
    from visbatch.settings import Settings
    from worker.runtime import Runtime

    return Runtime(Settings(), model=model, existing_db=existing_db)


def _files(paths: Sequence[PathLike], include: Sequence[str], exclude: Sequence[str]) -> list[Path]:
    from ingest.inputs import select_inputs

    given = [Path(p) for p in paths]
    selection = select_inputs(given, include, exclude)
    refused = selection.refusal(given)  # a missing path too: a visbatch.Error, as the CLI's exit 2
    if refused is not None:
        raise UserError(*refused)
    return selection.files


@_plain_errors
def run(
    paths: Sequence[PathLike],
    prompts: Sequence[str],
    *,
    schema: dict[str, Any] | PathLike | None = None,
    model: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    progress: Any = None,
    **options: Any,
) -> Job:
    """Run a job in this process (the embedded shape, like `visbatch run`) and return it once it
    has ended. `paths`: files, or folders (walked: documents only, or `include` globs).
    `options`: any job option of the CLI by its Python name (``max_new_tokens=64``, ``detail="low"``).
    `progress`: an object with ``update(stage, done, total)`` and ``note(message)``, or None."""
    from worker.drivers.embedded import EmbeddedRun

    spec = _spec(_options(prompts, schema, model, options))
    files = _files(paths, include, exclude)
    rt = _runtime(model)
    embedded = EmbeddedRun(rt, progress)
    job_id = embedded.run(files, spec)
    return Job(job_id, rt)


@_plain_errors
def submit(
    inputs: Sequence[PathLike],
    prompts: Sequence[str],
    *,
    schema: dict[str, Any] | PathLike | None = None,
    model: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    wait: bool = False,
    **options: Any,
) -> Job:
    """Send a job to the fleet (like `visbatch submit`): local files are uploaded to the store,
    ``s3://`` objects and prefixes are read in place. Returns at once, or when it ends (`wait`).
    Warns (NoWorkerWarning, on stderr) when no worker consumes a queue the job needs."""
    from worker.drivers.fleet.submit import missing_workers_warning, submit_job

    spec = _spec(_options(prompts, schema, model, options))
    local = [Path(i) for i in map(str, inputs) if not i.startswith("s3://")]
    remote = [i for i in map(str, inputs) if i.startswith("s3://")]
    files = [str(p) for p in _files(local, include, exclude)] if local else []
    rt = _runtime(model)
    handle = Job(submit_job(rt, files + remote, spec), rt)
    warning = missing_workers_warning(rt.settings)
    if warning:
        warnings.warn(warning.removeprefix("warning: "), NoWorkerWarning, stacklevel=2)
    return handle.wait() if wait else handle


class NoWorkerWarning(UserWarning):
    """A submitted job waits: no worker consumes a queue it needs."""


@_plain_errors
def job(job_id: str) -> Job:
    """An existing job, by id or unique prefix (6+ hex digits)."""
    from storage import repository as repo

    rt = _runtime(None, existing_db=True)
    return Job(repo.resolve_job_id(rt.db, job_id), rt)


@_plain_errors
def jobs(limit: int = 20) -> list[dict[str, Any]]:
    """The newest jobs first, with their counters (`visbatch jobs`)."""
    from storage import repository as repo

    return repo.list_jobs(_runtime(None, existing_db=True).db, limit=limit)


class Job:
    """A job in the database: its state, and its answers as records."""

    def __init__(self, job_id: str, runtime: Runtime) -> None:
        self.id = job_id
        self._rt = runtime

    def __repr__(self) -> str:
        return f"Job({self.id!r}, status={self.status!r})"

    @_plain_errors
    def summary(self) -> dict[str, Any]:
        """Status, counters, tokens, timing and errors (`visbatch status JOB --json`)."""
        from storage import repository as repo

        return repo.job_summary(self._rt.db, self.id)

    @property
    @_plain_errors
    def status(self) -> str:
        from storage import repository as repo

        state = repo.job_state(self._rt.db, self.id)
        return state[0] if state else "gone"

    @property
    @_plain_errors
    def prompts(self) -> list[str]:
        from storage import repository as repo

        state = repo.job_state(self._rt.db, self.id)
        return list((state[1] if state else {}).get("prompts") or [])

    @property
    def errors(self) -> list[dict[str, Any]]:
        """Failed sources, pages/frames and answers, each with its source, place and prompt."""
        return self.summary()["errors"]

    @_plain_errors
    def results(self) -> Iterator[dict[str, Any]]:
        """Every answer (errors included: see ``error``), ordered by source, page, prompt; streamed."""
        from storage import repository as repo
        from worker.results_export import asked, export_records

        state = repo.job_state(self._rt.db, self.id)
        spec = state[1] if state else {}
        prompts, then = asked(spec), list(spec.get("then") or [])
        yield from export_records(repo.iter_results(self._rt.db, self.id), prompts, then)

    @_plain_errors
    def to_pandas(self) -> Any:
        """The answers as a pandas DataFrame, one row per page/frame x prompt (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - pandas is in the dev and notebook extras
            raise ImportError("Job.to_pandas needs pandas: pip install pandas") from exc
        from worker.results_export import EXPORT_FIELDS

        return pd.DataFrame.from_records(list(self.results()), columns=EXPORT_FIELDS)

    @_plain_errors
    def write(self, path: PathLike, format: str | None = None) -> Path:  # noqa: A002 - as the CLI
        """Write the answers to a file: jsonl, csv or parquet, by the extension (.jsonl, .json,
        .csv, .parquet) or `format` (the rules of `visbatch results -o`: results_export.output_format)."""
        from worker.results_export import output_format, write_file

        path = Path(path)
        write_file(self.results(), path, output_format(path, format, option="format="))
        return path

    @_plain_errors
    def by_document(self, out_dir: PathLike) -> list[Path]:
        """One file per source, pages in order: Markdown (text answers) or JSON (schema answers)."""
        from storage import repository as repo
        from worker.results_export import write_by_document

        state = repo.job_state(self._rt.db, self.id)
        as_json = bool(state and state[1].get("json_schema") is not None)
        return write_by_document(self.results(), Path(out_dir), self.prompts, as_json=as_json, job_id=self.id)

    @_plain_errors
    def wait(self, timeout: float | None = None, poll_seconds: float = 1.0) -> Job:
        """Until the job ends (a fleet job); returns self."""
        from worker.drivers.fleet.submit import wait_for_job

        wait_for_job(self._rt, self.id, poll_seconds=poll_seconds, timeout=timeout)
        return self

    @_plain_errors
    def cancel(self) -> Job:
        """Stop the job's remaining work; what is done stays."""
        from worker.drivers.fleet.submit import cancel_job

        cancel_job(self._rt, self.id)
        return self

    @_plain_errors
    def resume(self, progress: Any = None) -> Job:
        """Continue a stopped job in this process (`visbatch resume`)."""
        from worker.drivers.embedded import EmbeddedRun

        model = self.summary()["spec"].get("model")
        if model and model != self._rt.model_name:
            self._rt = _runtime(model)
        EmbeddedRun(self._rt, progress).resume(self.id)
        return self
