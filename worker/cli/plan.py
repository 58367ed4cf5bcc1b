"""`visbatch plan`: what a job will cost (tokens, KV cache, GPU time, money) before running it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from visbatch.settings import Settings
from worker.cli.job_options import job_options
from worker.cli.main import console
from worker.cli.output import is_terminal, model_origin
from worker.errors import Unavailable, UserError
from worker.job_options import DEFAULT_PLAN_PROMPT, JobOptions
from worker.planning.fleet_sizing import S3_USD_PER_1000_GET, S3_USD_PER_1000_PUT, S3_USD_PER_GB_MONTH

if TYPE_CHECKING:
    from worker.planning.fleet_sizing import FleetFigures
    from worker.planning.planner import Plan

THROUGHPUT_HELP = (
    "use tokens per second ('20000' or '20000tok/s': prefill + decode) or pages per second ('3pages/s')"
)


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def format_gpu_time(hours: float) -> str:
    """GPU time in the unit that reads best: 0.3 GPU-seconds, 12.5 GPU-minutes, 3.2 GPU-hours."""
    if hours * 3600 < 60:
        return f"{hours * 3600:,.2g} GPU-seconds" if hours * 3600 < 10 else f"{hours * 3600:,.0f} GPU-seconds"
    if hours < 1:
        return f"{hours * 60:,.1f} GPU-minutes"
    return f"{hours:,.1f} GPU-hours"


def format_usd(amount: float) -> str:
    """Dollars with cents, or two significant digits under a cent ($0.00021): never `$0.00`."""
    if amount == 0 or amount >= 0.01:
        return f"${amount:,.2f}"
    decimals = -math.floor(math.log10(amount)) + 1
    return f"${amount:.{decimals}f}"


@job_options(prompt_required=False)
def plan(
    paths: Annotated[
        list[Path], typer.Argument(metavar="PATH", help="Files or folders (walked).", show_default=False)
    ],
    job: JobOptions,
    throughput: Annotated[
        str | None,
        typer.Option(metavar="RATE", help="GPU throughput: '20000' or '20000tok/s' (prefill+decode tokens), "
                     "or '3pages/s'. No default: measure yours."),
    ] = None,
    gpu_cost_per_hour: Annotated[
        float | None, typer.Option(metavar="USD", min=0, help="USD per GPU-hour (with --throughput).")
    ] = None,
    deadline: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="Finish within this ('24h', '90m', '2d'): GPUs needed, "
                     "and the hot cache they need."),
    ] = None,
    s3_gb_month: Annotated[
        float,
        typer.Option(metavar="USD", min=0, help="S3 storage price per GB-month (AWS S3 Standard list)."),
    ] = S3_USD_PER_GB_MONTH,
    s3_put_1000: Annotated[
        float, typer.Option(metavar="USD", min=0, help="S3 price per 1,000 PUT requests (AWS S3 Standard).")
    ] = S3_USD_PER_1000_PUT,
    s3_get_1000: Annotated[
        float, typer.Option(metavar="USD", min=0, help="S3 price per 1,000 GET requests (AWS S3 Standard).")
    ] = S3_USD_PER_1000_GET,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:  # fmt: skip
    """Estimate a job's tokens, KV cache, GPU time and cost.

    From the inputs and the model's config and processor only: no GPU, no weights, nothing
    rendered or decoded (one frame per video)."""
    # Imported here: the survey needs PyMuPDF and PyAV, which other commands should not pay for.
    from ingest.limits import Limits
    from worker.cli.inputs import chosen_files
    from worker.planning.planner import (
        WINDOW_FIXES,
        Throughput,
        dtype_bytes,
        load_plan_model,
        plan_job,
        windows_over_context,
    )
    from worker.stages.window_checks import refuse_window_misuse

    settings = Settings()
    spec = job.spec(default_prompt=DEFAULT_PLAN_PROMPT)
    rate = None
    if throughput:
        try:
            rate = Throughput.parse(throughput)
        except ValueError:
            raise UserError(f"--throughput {throughput}: not a throughput", THROUGHPUT_HELP) from None
    from worker.planning.fleet_sizing import S3Prices, pages_in_flight_per_gpu, parse_duration

    deadline_s = None
    if deadline:
        try:
            deadline_s = parse_duration(deadline)
        except ValueError as exc:
            raise UserError(f"--deadline {deadline}: {exc}", "e.g. --deadline 24h") from None
    given = (s3_gb_month, s3_put_1000, s3_get_1000)
    defaults = (S3_USD_PER_GB_MONTH, S3_USD_PER_1000_PUT, S3_USD_PER_1000_GET)
    prices = S3Prices(*given) if given == defaults else S3Prices(*given, source="given on the command line")
    files = chosen_files(paths, job)
    refuse_window_misuse(spec, files)  # as run and submit refuse them, before a figure is shown
    model = job.model or settings.model
    # As `run` says it (stderr: stdout keeps the plan): which model, and why that one.
    console.print(f"model: {escape(model)} (from {escape(model_origin(settings, job.model))})")
    try:
        plan_model = load_plan_model(model, settings.model_revision)
    except (OSError, ValueError) as exc:
        raise Unavailable(f"cannot read the config of model {model!r}: {exc}") from None
    result = plan_job(
        files,
        spec,
        plan_model,
        element_bytes=dtype_bytes(settings.dtype),
        limits=Limits.from_settings(settings),
        throughput=rate,
        gpu_cost_per_hour=gpu_cost_per_hour,
        deadline_s=deadline_s,
        pages_in_flight=pages_in_flight_per_gpu(settings.generate_window, settings.encode_chunk_units),
        prices=prices,
        hot_max_entry_bytes=settings.cache_hot_max_entry_bytes,
    )
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print_plan(result)
    refused = windows_over_context(result)
    if refused:
        raise UserError("; ".join(refused), WINDOW_FIXES)


def plan_table(result: Plan) -> Table:
    """The plan per source, whole at 80 columns: no borders, headers on two lines, figures never
    cut (a long file name wraps in its column); a source that cannot be read says why below."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("source", overflow="fold")
    table.add_column("kind", no_wrap=True)
    for name in ("pages+\nframes", "visual\ntokens", "prompt\ntokens", "KV per\nrequest"):
        table.add_column(name, justify="right", no_wrap=True)
    for s in [*result.sources, result.total]:
        name = s.source if s.source == "total" else Path(s.source).name
        if s.error:
            table.add_row(Text(name), s.kind or "?", "-", "-", "-", "error")
            continue
        table.add_row(
            Text(name), s.kind or "", f"{s.units:,}", f"{s.visual_tokens:,}", f"{s.prompt_tokens:,}",
            _gib(s.kv_bytes_per_request),
        )  # fmt: skip
    return table


def print_plan(result: Plan) -> None:
    out = Console(soft_wrap=not is_terminal(sys.stdout), highlight=False)
    out.print(plan_table(result))
    for s in result.sources:
        if s.error:
            out.print(Text(f"error: {Path(s.source).name}: {s.error}"))
    detail = result.detail or "model default"
    bounds = result.bounds
    out.print(
        f"model {result.model}: detail {detail} (max_pixels {bounds['max_pixels']:,}); "
        f"KV {result.kv_bytes_per_token:,} bytes/token ({result.dtype_bytes}-byte elements); "
        f"{result.prompts} prompt(s), max {result.max_new_tokens} new tokens; "
        f"{result.total.tokens:,} tokens over {result.total.requests:,} requests"
        + (" (prompt tokens estimated: no tokenizer)" if result.prompt_tokens_estimated else "")
    )
    if result.gpu_hours is not None and result.throughput is not None:
        rate = f"{result.throughput['value']:g} {result.throughput['unit']}"
        line = f"at {rate}: {format_gpu_time(result.gpu_hours)}"
        if result.cost_usd is not None:
            line += f", {format_usd(result.cost_usd)}"
            if result.cost_per_million_pages_usd is not None:
                line += f", {format_usd(result.cost_per_million_pages_usd)} per million pages/frames"
        out.print(line)
    if result.fleet is not None:
        print_fleet(out, result.fleet)
    for note in result.notes + [f"{Path(s.source).name}: {n}" for s in result.sources for n in s.notes]:
        out.print(f"note: {note}")


def _bytes(n: float) -> str:
    """Decimal units, as S3 and Redis capacity are sold: 850.0 MB, 12.4 GB, 1.2 TB."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def print_fleet(out: Console, fleet: FleetFigures) -> None:
    """The fleet lines of a plan: GPUs for the deadline, the cache's hot and cold bytes, S3."""
    if fleet.deadline_s is not None:
        out.print(f"fleet: {fleet.gpus:,} GPU(s) for {fleet.pages:,} pages/frames within "
                  f"{fleet.deadline_s / 3600:,.1f} h at {fleet.pages_per_gpu_s:,.2f} pages/s per GPU "
                  f"({format_gpu_time(fleet.gpu_hours)})")  # fmt: skip
    else:
        out.print(f"fleet: {fleet.pages_per_gpu_s:,.2f} pages/s per GPU, {format_gpu_time(fleet.gpu_hours)} "
                  "(add --deadline 24h for the GPUs it takes)")  # fmt: skip
    out.print(f"  throughput: {fleet.throughput_source}")
    out.print(f"  token cache ({fleet.cache_policy}): {_bytes(fleet.entry_bytes_mean)} a page on average; "
              f"hot (Redis) {_bytes(fleet.hot_bytes)} = {fleet.gpus:,} GPU(s) x "
              f"{fleet.pages_in_flight_per_gpu} pages in flight x 2 (safety); "
              f"cold (S3) {_bytes(fleet.cold_bytes)}")  # fmt: skip
    p = fleet.prices
    out.print(f"  S3: {fleet.s3_put:,} PUT + {fleet.s3_get:,} GET = {format_usd(fleet.s3_requests_usd)}; "
              f"storage {format_usd(fleet.s3_storage_usd_month)} a month while kept "
              f"(${p['usd_per_gb_month']:g}/GB-month, ${p['usd_per_1000_put']:g} per 1,000 PUT, "
              f"${p['usd_per_1000_get']:g} per 1,000 GET: {p['source']})")  # fmt: skip
    for note in fleet.notes:
        out.print(f"  note: {note}")
