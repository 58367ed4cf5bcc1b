"""`visbatch plan`: what a job will cost (tokens, KV cache, GPU time, money) before running it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ingest.spec import IngestOptions, JobSpec, Sampling, SpecError, describe_spec_error, schema_from_json
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
    visual_budget,
)

if TYPE_CHECKING:
    from worker.planner import Plan

DEFAULT_PROMPT = "What is on this page or frame? Answer in one sentence."
console = Console(stderr=True)


def _fail(message: str) -> None:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(2)


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def plan(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders (walked).", show_default=False)],
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="The job's prompt(s) (prompt tokens, auto detail)."),
    ] = None,
    schema: Annotated[
        Path | None, typer.Option(help="JSON schema file (its field names feed --detail auto).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Hub id or local folder (default: $VISBATCH_MODEL).")
    ] = None,
    longest_side: Annotated[int | None, typer.Option(help="PDF render: longest side in px.")] = 1288,
    dpi: Annotated[int | None, typer.Option(help="PDF render at this DPI instead.")] = None,
    pages: Annotated[str | None, typer.Option(help="PDF pages, 1-based ranges: '1-3,7'.")] = None,
    fps: Annotated[float | None, typer.Option(help="Video: frames per second to sample.")] = None,
    num_frames: Annotated[int | None, typer.Option(help="Video: N frames spread uniformly.")] = None,
    max_frames: Annotated[int, typer.Option(help="Video: at most this many frames (64 by default).")] = 64,
    keyframes: Annotated[
        bool, typer.Option("--keyframes", help="Video: sparse samples snap to the nearest keyframe.")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated at most per answer.")] = 256,
    detail: Detail = None,
    min_pixels: MinPixels = None,
    max_pixels: MaxPixels = None,
    max_tokens_per_frame: MaxTokensPerFrame = None,
    max_tokens_per_video: MaxTokensPerVideo = None,
    skip_redundant_frames: SkipFrames = True,
    redundancy_threshold: RedundancyThreshold = 3.0,
    prune_keep: PruneKeep = 1.0,
    merge_keep: MergeKeep = 1.0,
    throughput: Annotated[
        str | None,
        typer.Option(help="GPU throughput: '20000' or '20000tok/s' (prefill+decode tokens), or '3pages/s'."),
    ] = None,
    gpu_cost_per_hour: Annotated[float | None, typer.Option(help="USD per GPU-hour.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
) -> None:
    """Tokens, KV-cache bytes, GPU-hours and cost of a job, from the inputs and the model's config
    and processor only: no GPU, no weights, nothing rendered or decoded (one frame per video)."""
    # Imported here: the survey needs PyMuPDF and PyAV, which other commands should not pay for.
    from ingest.limits import Limits
    from worker.planner import Throughput, dtype_bytes, load_plan_model, plan_job

    settings = Settings()
    try:
        json_schema = schema_from_json(schema.read_bytes()) if schema is not None else None
        options: dict = {"max_frames": max_frames, "pages": pages, "num_frames": num_frames}
        options["keyframes"] = keyframes
        if dpi is not None:
            options.update(dpi=dpi, longest_side=None)
        elif longest_side is not None:
            options["longest_side"] = longest_side
        if fps is not None:
            options["fps"] = fps
        spec = JobSpec(
            prompts=prompt or [DEFAULT_PROMPT],
            json_schema=json_schema,
            sampling=Sampling(max_new_tokens=max_new_tokens),
            ingest=IngestOptions(**options),
            budget=visual_budget(
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
        rate = Throughput.parse(throughput) if throughput else None
    except ValidationError as exc:  # the same words as run, submit and the drop folder
        _fail(f"invalid job spec: {describe_spec_error(exc)}")
        return
    except (OSError, SpecError) as exc:
        _fail(f"--schema {schema}: {exc}")
        return
    except ValueError as exc:
        _fail(str(exc))
        return
    try:
        plan_model = load_plan_model(model or settings.model, settings.model_revision)
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the model's config: {exc}")
        return
    result = plan_job(
        paths,
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
    out = Console()
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
        line = f"at {rate}: {result.gpu_hours:,.4g} GPU-hours"
        if result.cost_usd is not None:
            line += f", ${result.cost_usd:,.2f}"
            if result.cost_per_million_pages_usd is not None:
                line += f", ${result.cost_per_million_pages_usd:,.0f} per million pages/frames"
        out.print(line)
    for note in result.notes + [f"{Path(s.source).name}: {n}" for s in result.sources for n in s.notes]:
        out.print(f"note: {note}")
