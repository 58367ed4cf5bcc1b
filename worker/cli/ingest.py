"""`visbatch ingest`: sources to page and frame images and a manifest, on the CPU alone.

No model weights and no torch: a visual-token count per image comes from the model's small JSON
files (ingest.token_rules) when a model is named (--model, or VISBATCH_MODEL) and they can be
read; without one the images and the manifest are written all the same. Progress and the final
count go to stderr as plain lines (a log file gets whole lines, a terminal one updated line);
stdout gets the manifest's path only.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import typer

from ingest.spec import IngestOptions
from worker.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PARTIAL, EXIT_USAGE

UNIT_WORDS = {"pdf": ("page", "pages"), "video": ("frame", "frames"), "image": ("image", "images")}


def usable_cpus() -> int:
    """Cores this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_ingest(
    paths: list[Path],
    out_dir: Path,
    model: str | None,
    options: IngestOptions,
    *,
    processes: int | None = None,
    overwrite: bool = False,
) -> None:
    """The body of `visbatch ingest` (declared in worker.cli.run with the other commands' options)."""
    from ingest.export import OutputFolderError, check_output_folder, export_sources
    from ingest.stage import expand_paths

    try:
        check_output_folder(out_dir, overwrite)
    except OutputFolderError as exc:
        _fail(str(exc))
    if not expand_paths(paths):
        _fail(f"no input files found in {', '.join(map(str, paths))}")
    count_tokens, model_name = _token_counter(model)
    progress = IngestProgress(sys.stderr)
    records = export_sources(
        paths, out_dir, options, count_tokens, processes=processes or usable_cpus(), overwrite=overwrite
    )
    try:
        for record in records:
            progress.add(record)
    except KeyboardInterrupt:
        records.close()
        progress.line(f"interrupted: {out_dir} was left as it was")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except OutputFolderError as exc:  # OUT changed while we ran
        _fail(str(exc))
    progress.finish(out_dir, model_name)
    print(out_dir / "manifest.jsonl")
    if progress.written == 0:
        raise typer.Exit(EXIT_FAILED)
    if progress.failed_units or progress.failed_sources:
        raise typer.Exit(EXIT_PARTIAL)


def _token_counter(model: str | None):
    """The token rule's counter and the model's name, or (None, None) without a usable model.

    The model is chosen as `run` chooses it (--model, VISBATCH_MODEL, then this folder's
    `visbatch model use`), but the built-in default is not reached for: ingest needs no model, and
    must not wait on the hub for one nobody chose. A model named with --model must be usable
    (else a usage error); a chosen one that cannot be read only costs the counts, with a note.
    """
    from ingest.token_rules import load_token_rule
    from visbatch.settings import Settings

    settings = Settings()
    chosen = settings.model if settings.model_origin != "default" else None
    name = model or chosen
    if name is None:
        return None, None
    try:
        rule = load_token_rule(name, settings.model_revision)
    except (OSError, ValueError) as exc:  # unreachable files, unsupported family, bad JSON
        if model is not None:
            _fail(f"--model {name}: {exc}")
        origin = settings.model_origin
        where = f"VISBATCH_MODEL={name}" if origin == "VISBATCH_MODEL" else f"{name} (from {origin})"
        print(f"note: no visual-token counts: {where}: {exc}", file=sys.stderr)
        return None, None
    return rule.count_visual_tokens, name


def _fail(message: str) -> None:
    """A usage error: one plain line (never wrapped: logs are read with grep), exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(EXIT_USAGE)


class IngestProgress:
    """Counts records and says how far along we are: one updated line on a terminal, else a
    line every LOG_EVERY seconds; each failure on a line of its own, as it happens."""

    TTY_EVERY = 0.25
    LOG_EVERY = 10.0

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._shown = self.started
        self._pending = False  # a terminal line is on screen, to be cleared before the next line
        self.units: Counter[str] = Counter()
        self.sources: set[str] = set()
        self.failed_sources = 0
        self.failed_units = 0

    @property
    def written(self) -> int:
        return sum(self.units.values())

    def add(self, record: dict[str, Any]) -> None:
        self.sources.add(record["source"])
        if "error" in record and "unit" not in record:
            self.failed_sources += 1
            self.line(f"error: {record['source']}: {record['error']}")
        elif "error" in record:
            self.failed_units += 1
            self.line(f"error: {record['source']}, {_where(record)}: {record['error']}")
        else:
            self.units[record["kind"]] += 1
        now = time.monotonic()
        if now - self._shown >= (self.TTY_EVERY if self.tty else self.LOG_EVERY):
            self._shown = now
            self._status(now)

    def line(self, text: str) -> None:
        if self._pending:
            self.stream.write("\r\033[K")
            self._pending = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _status(self, now: float) -> None:
        text = f"ingest: {self._counts()} from {_plural(len(self.sources), 'source')}, {self._rate(now)}"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self._pending = True
        else:
            self.line(text)

    def finish(self, out_dir: Path, model: str | None) -> None:
        now = time.monotonic()
        failed = [
            _plural(self.failed_sources, "source") if self.failed_sources else "",
            _plural(self.failed_units, "page or frame", "pages or frames") if self.failed_units else "",
        ]
        failed_text = " and ".join(f for f in failed if f)
        tokens = (
            f"visual tokens counted for {model}"
            if model
            else "no visual-token counts (no model chosen: --model or `visbatch model use`)"
        )
        self.line(
            f"ingest: wrote {self._counts()} from {_plural(len(self.sources), 'source')} to {out_dir} "
            f"in {now - self.started:.1f} s ({self._rate(now)}); {tokens}"
            + (f"; {failed_text} failed" if failed_text else "")
        )

    def _counts(self) -> str:
        parts = [_plural(self.units[kind], *UNIT_WORDS[kind]) for kind in UNIT_WORDS if self.units[kind]]
        return ", ".join(parts) or "0 images"

    def _rate(self, now: float) -> str:
        return f"{self.written / max(now - self.started, 1e-6):,.1f} images/s"


def _where(record: dict[str, Any]) -> str:
    singular = UNIT_WORDS.get(record.get("kind", ""), ("unit", "units"))[0]
    where = f"{singular} {record['unit'] + 1}"
    if record.get("timestamp") is not None:
        where += f" (at {record['timestamp']:.2f} s)"
    return where


def _plural(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
