"""The input files of a command: paths checked, folders walked and filtered (ingest.inputs), and
what was left out said once on stderr."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import typer

from worker.errors import UserError
from worker.options import JobOptions


def chosen_files(paths: Sequence[Path], job: JobOptions, *, quiet: bool = False) -> list[Path]:
    """The files a job takes, in order. A path that does not exist, or no file at all, is a
    usage error (exit 2) before anything starts: a typo must not become a failed job."""
    from ingest.inputs import select_inputs  # PyAV comes with it: only commands that take files

    selection = select_inputs(paths, job.include, job.exclude)
    if selection.missing:
        names = ", ".join(str(p) for p in selection.missing[:5])
        raise UserError(f"no such file or folder: {names}", "check the path (folders are walked)")
    if not selection.files:
        given = ", ".join(str(p) for p in paths[:5])
        left = len(selection.skipped) + len(selection.excluded)
        detail = f"; {left} file(s) left out by the filters or as not documents" if left else ""
        raise UserError(
            f"no input files found in {given}{detail}",
            "give PDFs, videos or images, or folders holding them (--include GLOB picks other files)",
        )
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


def check_readable(files: Sequence[Path]) -> None:
    """Refuse (exit 2) before any model loads when not one file can be a source: a job of only
    failed sources would take the model's load time to say what these bytes already say. Some
    bad files among good ones do not stop the run: each becomes its source's error in the job."""
    reasons = {path: unreadable_reason(path) for path in files}
    if all(reasons.values()):
        shown = "; ".join(f"{path}: {reason}" for path, reason in list(reasons.items())[:5])
        raise UserError(
            f"no input can be read: {shown}", "give readable PDFs, videos or images (nothing was started)"
        )
