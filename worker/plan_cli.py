"""`visbatch plan`: what a job will cost (tokens, KV cache, GPU time, money) before running it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from storage.settings import Settings
from worker.cli_errors import UserError
from worker.cli_options import DEFAULT_PLAN_PROMPT, JobOptions, job_options
from worker.cli_output import is_terminal

if TYPE_CHECKING:
    from worker.planner import Plan

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
    gpu_cost_per_hour: Annotated[float | None, typer.Option(metavar="USD", help="USD per GPU-hour.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:  # fmt: skip
    """Tokens, KV-cache bytes, GPU time and cost of a job, from the inputs and the model's config
    and processor only: no GPU, no weights, nothing rendered or decoded (one frame per video)."""
    # Imported here: the survey needs PyMuPDF and PyAV, which other commands should not pay for.
    from ingest.limits import Limits
    from worker.cli_inputs import chosen_files
    from worker.planner import Throughput, dtype_bytes, load_plan_model, plan_job

    settings = Settings()
    spec = job.spec(default_prompt=DEFAULT_PLAN_PROMPT)
    rate = None
    if throughput:
        try:
            rate = Throughput.parse(throughput)
        except ValueError:
            raise UserError(f"--throughput {throughput}: not a throughput", THROUGHPUT_HELP) from None
    files = chosen_files(paths, job)
    model = job.model or settings.model
    try:
        plan_model = load_plan_model(model, settings.model_revision)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the config of model {model!r}: {exc}", code=4) from None
    result = plan_job(
        files,
        spec,
        plan_model,
        element_bytes=dtype_bytes(settings.dtype),
        limits=Limits.from_settings(settings),
        throughput=rate,
        gpu_cost_per_hour=gpu_cost_per_hour,
    )
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print_plan(result)


def print_plan(result: Plan) -> None:
    out = Console(soft_wrap=not is_terminal(sys.stdout), highlight=False)
    table = Table("source", "kind", "pages/frames", "visual tokens", "prompt tokens", "KV / request")
    for s in [*result.sources, result.total]:
        name = s.source if s.source == "total" else Path(s.source).name
        if s.error:
            table.add_row(name, s.kind or "?", "-", "-", "-", f"error: {s.error}")
            continue
        table.add_row(
            name, s.kind or "", f"{s.units:,}", f"{s.visual_tokens:,}", f"{s.prompt_tokens:,}",
            _gib(s.kv_bytes_per_request),
        )  # fmt: skip
    out.print(table)
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
    for note in result.notes + [f"{Path(s.source).name}: {n}" for s in result.sources for n in s.notes]:
        out.print(f"note: {note}")
