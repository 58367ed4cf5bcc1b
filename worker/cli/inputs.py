"""The input files of a command: paths checked, folders walked and filtered (ingest.inputs), and
what was left out said once on stderr."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import typer

from worker.errors import UserError
from worker.job_options import JobOptions


def chosen_files(paths: Sequence[Path], job: JobOptions, *, quiet: bool = False) -> list[Path]:
    """The files a job takes, in order. A path that does not exist, or no file at all, is a
    usage error (exit 2) before anything starts: a typo must not become a failed job."""
    from ingest.inputs import select_inputs  # PyAV comes with it: only commands that take files

    selection = select_inputs(paths, job.include, job.exclude)
    refused = selection.refusal(paths)
    if refused is not None:
        raise UserError(*refused)
    note = selection.describe_skipped()
    if note and not quiet:
        typer.echo(note, err=True)
    return selection.files


def unreadable_reason(path: Path) -> str | None:
    """Why a file surely cannot be a source, from its first bytes alone (no PDF or video library:
    those run isolated, in the job); None when it may be one."""
    from ingest.detect import PDF_MAGIC, PDF_MAGIC_WINDOW

    try:
        with open(path, "rb") as handle:
            head = handle.read(PDF_MAGIC_WINDOW)
    except OSError as exc:
        return (exc.strerror or type(exc).__name__).lower()
    if not head:
        return "empty file"
    if path.suffix.lower() == ".pdf" and PDF_MAGIC not in head:
        return "not a PDF (no %PDF- header in its first 1 KiB)"
    return None


def check_readable(files: Sequence[Path]) -> dict[Path, str]:
    """Refuse (exit 2) before any model loads when not one file can be a source: a job of only
    failed sources would take the model's load time to say what these bytes already say. Some
    bad files among good ones do not stop the run: each becomes its source's error in the job,
    and they are returned (with why) for the command to name them at once, before the model."""
    reasons = {path: unreadable_reason(path) for path in files}
    if all(reasons.values()):
        shown = "; ".join(f"{path}: {reason}" for path, reason in list(reasons.items())[:5])
        raise UserError(
            f"no input can be read: {shown}", "give readable PDFs, videos or images (nothing was started)"
        )
    return {path: reason for path, reason in reasons.items() if reason}


def unreadable_lines(unreadable: dict[Path, str], total: int, limit: int = 5) -> list[str]:
    """What `run` says at once of the files that cannot be sources among others that can: one
    line each (the first `limit`), then what becomes of them and of the job."""
    from worker.cli.output import shown_path

    if not unreadable:
        return []
    first = list(unreadable.items())[:limit]
    lines = [f"warning: {shown_path(str(path))}: {reason}" for path, reason in first]
    if len(unreadable) > limit:
        lines.append(f"warning: and {len(unreadable) - limit} more that cannot be read")
    lines.append(
        f"warning: the job runs the other {total - len(unreadable)} file(s); {len(unreadable)} will be "
        "failed source(s) (the job ends partial at best)"
    )
    return lines
