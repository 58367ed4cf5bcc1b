"""What the `visbatch` command prints: consoles, progress, a job's summary and its first answers.

Output goes to two kinds of reader. In a terminal: progress bars, redrawn in place. In a log
file or a pipe: plain lines that never wrap (a log is grepped, and a message cut at 80 columns
in mid-sentence reads as two), in the order things happened: a progress line every few seconds
and at the end, notes and warnings between them as they come.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from worker.results_export import place, question, span

# In a pipe or a log, a progress line at most this often (seconds).
PROGRESS_LINE_SECONDS = float(os.environ.get("VISBATCH_PROGRESS_SECONDS", "10"))


def token_lines(tokens: dict | None) -> list[tuple[str, str]]:
    """`visbatch status` / `results`: a job's tokens (storage.token_report) as rows: what was spent,
    then what the budget, the cache and the reductions saved (only when they saved anything)."""
    if not tokens:
        return []
    spent, saved = tokens["spent"], tokens["saved"]
    # What went through the tower (or came from the cache); a stopped job's pages+frames split but
    # not encoded yet are planned, not spent (storage.token_report).
    later = ""
    if tokens.get("units_not_encoded"):
        later = (
            f"; {tokens['visual_not_encoded']:,} more planned for the "
            f"{tokens['units_not_encoded']:,} not encoded yet"
        )
    lines = [
        (
            "tokens",
            f"visual {spent['visual']:,} for the pages+frames encoded ({spent['visual_to_lm']:,} to the "
            f"LM over all prompts), prompt {spent['prompt']:,}, completion {spent['completion']:,}{later}",
        )
    ]
    if any(saved.values()):
        lines.append(
            (
                "tokens saved",
                f"detail {saved['detail']:,}, skipped frames {saved['skipped_frames']:,} "
                f"({tokens['units_skipped']} frames), cache hits {saved['cache_hits']:,} "
                f"({tokens['cache_hit_units']} units, {tokens['identical_images']} identical images), "
                f"pruning {saved['pruning']:,}, merging {saved['merging']:,}; "
                f"{tokens['without_budget']:,} visual tokens without the budget",
            )
        )
    return lines


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 on a closed pipe; the command group ends quietly with 0 (worker.errors).
        self.quiet = True
        raise BrokenPipeError


def make_console(*, stderr: bool) -> Console:
    """A console that wraps only in a terminal (soft_wrap elsewhere: one message, one line)."""
    stream = sys.stderr if stderr else sys.stdout
    terminal = is_terminal(stream)
    return _Console(stderr=stderr, soft_wrap=not terminal, highlight=False)


def shown_path(uri: str) -> str:
    """A source as a person typed it: relative to the current folder when it lies under it."""
    try:
        path = Path(uri)
        if path.is_absolute():
            return str(path.relative_to(Path.cwd()))
    except (ValueError, OSError):
        pass
    return uri


def model_origin(settings: Any, explicit: str | None) -> str:
    """Where a command's model comes from, as its `model: X (from ...)` line says it: --model,
    VISBATCH_MODEL, the config.json of `visbatch model use`, or the built-in default."""
    if explicit:
        return "--model"
    origin = settings.model_origin
    if origin == "default":
        return "the built-in default; `visbatch model use` changes it"
    return origin if origin == "VISBATCH_MODEL" else shown_path(origin)


class LineProgress:
    """Progress as plain lines (pipes, log files): one every PROGRESS_LINE_SECONDS and one at the end."""

    LABELS = {"sources": "sources", "units": "pages+frames", "encode": "encoded", "generate": "answered"}

    def __init__(self, console: Console, every: float = PROGRESS_LINE_SECONDS) -> None:
        self.console = console
        self.every = every
        self.state: dict[str, tuple[int, int | None]] = {}
        self.started = time.monotonic()
        self.last = self.started
        self.printed: str | None = None
        self.lock = threading.Lock()

    def update(self, stage: str, done: int, total: int | None = None) -> None:
        with self.lock:
            self.state[stage] = (done, total)
            now = time.monotonic()
            if now - self.last >= self.every:
                self.last = now
                self._print(now)

    def note(self, message: str) -> None:
        self.console.print(escape(message))

    def line(self) -> str:
        parts = []
        for stage, label in self.LABELS.items():
            if stage in self.state:
                done, total = self.state[stage]
                parts.append(f"{label} {done}/{total}" if total is not None else f"{label} {done}")
        return ", ".join(parts)

    def _print(self, now: float) -> None:
        self.printed = self.line()
        self.console.print(f"progress: {self.printed} ({now - self.started:.0f} s)")

    def finish(self) -> None:
        with self.lock:
            if self.state and self.line() != self.printed:  # the last state, once
                self._print(time.monotonic())


class RichProgress:
    """Progress bars in a terminal: sources, then units as each stage gets through them (totals grow)."""

    LABELS = LineProgress.LABELS

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def update(self, stage: str, done: int, total: int | None = None) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(self.LABELS.get(stage, stage), total=total)
        self.progress.update(self.tasks[stage], completed=done, total=total)

    def note(self, message: str) -> None:
        self.progress.console.print(escape(message))


class progress_display:  # noqa: N801 - a context manager used like a function
    """Bars in a terminal, lines elsewhere: ``with progress_display(console) as progress: ...``."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._bars: Any = None
        self._lines: LineProgress | None = None

    def __enter__(self) -> RichProgress | LineProgress:
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            columns = [
                TextColumn("{task.description:>12}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            ]
            self._bars = Progress(*columns, console=self.console)
            self._bars.__enter__()
            return RichProgress(self._bars)
        self._lines = LineProgress(self.console)
        return self._lines

    def __exit__(self, *exc: Any) -> None:
        if self._bars is not None:
            self._bars.__exit__(*exc)
        if self._lines is not None:
            self._lines.finish()


# --- a job's summary ----------------------------------------------------------------------------

MAX_ERRORS_SHOWN = 20


def describe_error(err: dict[str, Any]) -> str:
    """'invoice.pdf page 2, "What is the total?": output is not valid JSON ...'"""
    where = shown_path(err["source"])
    spot = place(err.get("kind"), err.get("unit"), err.get("timestamp"))
    if spot:
        where += f" {spot}"
    if err.get("prompt_text") is not None:
        where += f', "{one_line(err["prompt_text"], 60)}"'
    elif err.get("prompt") is not None:
        where += f", prompt {err['prompt'] + 1}"
    return f"{where}: {err['message']}"


def one_line(text: str, width: int) -> str:
    """Text on one line of at most `width` characters, control characters dropped."""
    flat = " ".join("".join(ch for ch in str(text) if ch.isprintable() or ch.isspace()).split())
    return flat if len(flat) <= width else flat[: width - 3].rstrip() + "..."


def cache_policy(s: dict[str, Any]) -> str:
    """The job's token-cache policy (ingest.spec.CachePolicy); jobs from before it was one: cold."""
    return str((s.get("spec") or {}).get("cache") or "cold")


def _per_window(s: dict[str, Any]) -> str:
    """', over windows of 3 pages or frames' for a windowed job (ingest.windows); else nothing."""
    window = (s.get("spec") or {}).get("window")
    if not window:
        return ""
    from ingest.windows import describe, parse_window

    return f", over {describe(parse_window(window))}"


def summary_lines(s: dict[str, Any]) -> list[tuple[str, str]]:
    """A job's state as (label, value) pairs: counts in words, pages and prompts as people count."""

    def n(key: str) -> int:
        return int(s.get(key) or 0)

    activity = s.get("activity")
    status = str(s["status"])
    if activity and activity.get("state") == "interrupted":
        status = "interrupted"  # its process is gone: derived (the stored status stays running)
    lines = [
        ("status", status),
        ("sources", f"{n('sources_total'):,} ({n('sources_failed'):,} failed)"),
        ("pages+frames", f"{n('units_total'):,} ({n('units_failed'):,} failed)"),
        ("answers", f"{n('results'):,} ({n('results_failed'):,} failed){_per_window(s)}"),
        ("vision tower", f"{n('cache_misses'):,} images encoded, {n('cache_hits'):,} from the cache"
                         f" (cache policy {cache_policy(s)})"),
    ]  # fmt: skip
    # One tokens row: the report's when there is one (it tells the pages' tokens from what the LM
    # was given), else the job's counters.
    lines += token_lines(s.get("tokens")) or [
        ("tokens", f"visual {n('visual_tokens'):,}, prompt {n('prompt_tokens'):,}, "
                   f"completion {n('completion_tokens'):,}"),
    ]  # fmt: skip
    model = (s.get("spec") or {}).get("model")
    if model:
        lines.append(("model", str(model)))
    # A job that waits for a worker, has stalled or was interrupted gets the reason, not an ETA
    # it will not keep.
    lines += timing_lines(s.get("timing"), eta=activity is None or bool(activity.get("eta")))
    if activity:
        lines.append(("progress", str(activity["message"])))
    if s.get("error"):
        lines.append(("reason", str(s["error"])))
    return lines


def timing_lines(timing: dict | None, *, eta: bool = True) -> list[tuple[str, str]]:
    """Wall time (and, for a resumed job, the time since the resume), time to the first result,
    pages+frames answered per second, each stage's busy time, and (`eta`) a running job's rate
    and time left (storage.jobs._timing says what each counts)."""
    if not timing or timing.get("wall_seconds") is None:
        return []
    busy = timing["busy_seconds"]
    took = [f"wall {timing['wall_seconds']:.1f} s"]
    resumed = timing.get("since_resume_seconds") is not None
    if resumed:
        took.append(f"{timing['since_resume_seconds']:.1f} s since the last resume")
    if timing.get("first_result_seconds") is not None:
        took.append(f"first result after {timing['first_result_seconds']:.1f} s")
    if timing.get("answered_units_per_second") is not None:
        took.append(f"{timing['answered_units_per_second']:.2f} pages+frames answered/s")
    lines = [("time", ", ".join(took))]
    if busy:
        # Each stage's working time (a stage's includes loading what it needs: the model), summed
        # over every thread and process that worked on it: several at once exceed the wall time.
        stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in busy.items())
        lines.append(("busy", f"{stages} (summed over threads and processes)"))
    if eta and timing.get("eta_seconds") is not None:  # a running job: its rate so far, and time left at it
        since = " since the resume" if resumed else ""
        lines.append(("rate, time left", f"{timing['rate_units_per_second']:.2f} pages+frames answered/s"
                      f"{since}, about {timing['eta_seconds']:.0f} s at that rate"))  # fmt: skip
    return lines


def print_summary(console: Console, s: dict[str, Any]) -> None:
    """The summary as aligned `label  value` lines (no table: nothing wraps inside a cell)."""
    console.print(f"job {s['id']}", highlight=False)
    lines = summary_lines(s)
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        console.print(f"  {label:<{width}}  {escape(value)}", highlight=False)
    errors = s.get("errors") or []
    if errors:
        more = " (first ones)" if s.get("errors_truncated") or len(errors) > MAX_ERRORS_SHOWN else ""
        console.print(f"errors{more}:")
        for err in errors[:MAX_ERRORS_SHOWN]:
            console.print(f"  {escape(describe_error(err))}", highlight=False)
        if len(errors) > MAX_ERRORS_SHOWN or s.get("errors_truncated"):
            console.print(f"  ... all of them: visbatch status {s['id']} --json", highlight=False)


def print_preview(
    console: Console,
    prompts: list[str],
    then: list[list[str]],
    preview: dict[tuple[int, int], list[dict]],
) -> None:
    """The first answers of each prompt and follow-up turn (`--then`), one line each."""
    preview = {key: records for key, records in preview.items() if records}
    if not preview:
        return
    console.print("first answers:")
    for (index, turn), records in sorted(preview.items()):
        asked = question(prompts, then, index, turn) or f"prompt {index + 1}"
        heading = f'"{one_line(asked, 70)}"' + (f" (follow-up {turn})" if turn else "")
        console.print(f"  {escape(heading)}", highlight=False)
        for r in records:
            last = r["unit"] if r.get("unit_to") is None else r["unit_to"]
            at = span(r["kind"], r["unit"], last, r["timestamp"], r.get("timestamp_to"))
            where = f"{Path(r['source']).name} {at}".strip()
            if r["error"]:
                answer = f"error: {r['error']}"
            elif r["output"] is not None:
                import json

                answer = json.dumps(r["output"], ensure_ascii=False)
            else:
                answer = r["text"] or ""
            console.print(f"    {escape(where)}: {escape(one_line(answer, 100))}", highlight=False)
