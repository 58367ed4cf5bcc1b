"""`visbatch plan`: tokens, KV-cache bytes, GPU time and cost of a job, before running it.

No GPU and no weights: the model's config (layers, KV heads, head dim), its processor's resize
rule, and, when the model folder has one, its tokenizer and chat template (for exact prompt
tokens; without one they are estimated and marked so). Sources are surveyed without rendering
or decoding (ingest.survey). The figures are those a run records: visual tokens per page/frame
by the same resize rule and budget, prompt tokens by the same template.

KV bytes per request = 2 (K and V) x layers x KV heads x head dim x tokens x bytes per element,
tokens = visual + prompt + max new tokens (what one request holds at its end).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ingest.budget import (
    PixelBounds,
    TokenGeometry,
    job_bounds,
    resolve_level,
    video_cap_bounds,
)
from ingest.limits import Limits
from ingest.prompt_tokens import load_prompt_counter
from ingest.spec import JobSpec
from ingest.stage import expand_paths
from ingest.survey import survey_source
from ingest.token_rules import load_token_rule, read_json_file
from ingest.windows import windows_of
from worker.planning.fleet_sizing import (
    THROUGHPUT_SOURCE,
    FleetFigures,
    ModelShape,
    S3Prices,
    assumed_pages_per_second,
    fleet_figures,
    model_shape,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Qwen2-VL's chat template around a prompt (system turn, user turn, image markers, assistant
# header): about 21 tokens with its BPE; text is about 4 characters a token in English.
TEMPLATE_TOKENS_ESTIMATE = 21
CHARS_PER_TOKEN_ESTIMATE = 4


def dtype_bytes(dtype: str) -> int:
    """Bytes per KV element for VISBATCH_DTYPE; `auto` plans for a GPU (bf16)."""
    return DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


def kv_shape_from_config(config: dict[str, Any]) -> KVShape:
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads") or config["num_attention_heads"])
    hidden = int(text.get("hidden_size") or config["hidden_size"])
    return KVShape(
        layers=int(text.get("num_hidden_layers") or config["num_hidden_layers"]),
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
    )


@dataclass
class PlanModel:
    """The model as the planner needs it (built from its files, never its weights)."""

    name: str
    geometry: TokenGeometry
    kv: KVShape
    count_visual_tokens: Callable[[int, int, PixelBounds | None], int]
    prompt_tokens: Callable[[str], int] | None  # None: no tokenizer, estimated
    shape: ModelShape | None = None  # cache width and parameter counts (fleet figures)
    context: int | None = None  # the LM's context in tokens (None: its config does not say)
    # Tokens of each image of a window of several on the family's window view (None: the usual
    # view's; ingest.token_rule_base.TokenRule.window_view_tokens).
    window_view_tokens: int | None = None


def load_plan_model(model: str, revision: str | None = None) -> PlanModel:
    """The model as its files describe it: config.json (KV shape), the family's token rule, and its
    tokenizer and chat template when it has them (exact prompt tokens; else they are estimated).
    Never torch or transformers: planning costs a fraction of a second."""
    config = read_json_file(model, "config.json", revision)
    if config is None:
        raise FileNotFoundError(f"no config.json for model {model!r} (a local folder or a reachable hub id)")
    kv = kv_shape_from_config(config)
    # The family's own rule; an unsupported family is a clear error (UnsupportedModel).
    rule = load_token_rule(model, revision)
    try:
        prompt_tokens = load_prompt_counter(model, revision)
    except Exception:  # a template this renderer cannot run: estimated, and the plan says so
        prompt_tokens = None
    try:
        shape: ModelShape | None = model_shape(config)
    except (KeyError, TypeError, ValueError):  # a config sizing cannot read: no fleet figures
        shape = None
    text = config.get("text_config") or config
    context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return PlanModel(
        model,
        rule.token_geometry,
        kv,
        rule.count_visual_tokens,
        prompt_tokens,
        shape,
        int(context) if context else None,
        rule.window_view_tokens,
    )


def estimate_prompt_tokens(prompt: str) -> int:
    return TEMPLATE_TOKENS_ESTIMATE + math.ceil(len(prompt) / CHARS_PER_TOKEN_ESTIMATE)


@dataclass(frozen=True)
class Throughput:
    value: float
    unit: str  # "tokens/s" or "pages/s"

    @classmethod
    def parse(cls, text: str) -> Throughput:
        """`5000`, `5000tok/s` or `5000tokens/s` (prefill + decode tokens per second), or `2.5pages/s`
        (requests - a page or frame asked one prompt - per second)."""
        raw = text.strip().lower().replace(" ", "")
        unit = "tokens/s"
        for suffix, meaning in (
            ("tokens/s", "tokens/s"), ("tok/s", "tokens/s"), ("pages/s", "pages/s"),
            ("frames/s", "pages/s"), ("units/s", "pages/s"), ("requests/s", "pages/s"),
        ):  # fmt: skip
            if raw.endswith(suffix):
                raw, unit = raw.removesuffix(suffix), meaning
                break
        value = float(raw)
        if not value > 0:
            raise ValueError("throughput must be positive")
        return cls(value, unit)


@dataclass
class SourcePlan:
    source: str
    kind: str | None
    units: int = 0  # pages, frames or images
    requests: int = 0  # units x prompts
    visual_tokens: int = 0  # per unit, summed (what ingest records)
    visual_tokens_max: int = 0  # of one unit
    # Visual tokens the LM is given over all requests (status --json: tokens.spent.visual_to_lm):
    # each unit's once per question, a window's units once per window and question (overlapping
    # windows show a unit again).
    visual_to_lm: int = 0
    prompt_tokens: int = 0  # over all requests
    tokens: int = 0  # over all requests: visual + prompt + max new tokens
    kv_bytes_per_request: int = 0  # the largest request
    duration_s: float | None = None
    max_pixels: int | None = None  # the bounds this source's units get (None: the model's own)
    error: str | None = None
    over_context: bool = False  # a window that does not fit the model's context (error says so)
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    model: str
    detail: str | None  # the level the budget resolved to (auto resolved), None: the model's own
    bounds: dict[str, int]
    prompt_tokens_estimated: bool
    kv_bytes_per_token: int
    dtype_bytes: int
    max_new_tokens: int
    prompts: int
    sources: list[SourcePlan]
    total: SourcePlan
    throughput: dict[str, Any] | None = None
    gpu_hours: float | None = None
    cost_usd: float | None = None
    cost_per_million_pages_usd: float | None = None
    fleet: FleetFigures | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# What to change when a window does not fit the model's context.
WINDOW_FIXES = (
    "fewer tokens per frame (--detail low, --max-tokens-per-frame N), a smaller --window "
    "or fewer --max-new-tokens"
)


def windows_over_context(plan: Plan) -> list[str]:
    """The sources whose windows do not fit the model's context, with their tokens (a job with
    any is refused before it starts: `plan`, `run`, `submit`)."""
    return [f"{Path(s.source).name}: {s.error}" for s in plan.sources if s.over_context]


def _question_tokens(spec: JobSpec, counter: Callable[[str], int]) -> list[int]:
    """Prompt tokens of every request a unit (or window) makes: each prompt, and each follow-up
    turn (`--then`) with the turns before it and their answers, counted at --max-new-tokens."""
    counts = []
    for p in range(len(spec.prompts)):
        before = 0
        for question in spec.turns(p):
            counts.append(counter(question) + before)
            before += counter(question) + spec.sampling.max_new_tokens
    return counts


def _windowed(
    visuals: list[int], spec: JobSpec, duration: float | None, view_tokens: int | None
) -> list[int]:
    """Visual tokens per window of a source's units (ingest.windows), each image of a window of
    several at `view_tokens` where the family has a window view; a video's frames taken as
    spread evenly over its duration (as --fps and --num-frames sample them)."""
    plan = spec.window_plan()
    assert plan is not None
    times = [i * (duration or 0.0) / len(visuals) for i in range(len(visuals))] if visuals else []
    return [
        (last - first + 1) * view_tokens
        if view_tokens is not None and last > first
        else sum(visuals[first : last + 1])
        for first, last in windows_of(plan, times)
    ]


def plan_job(
    paths: list[Path],
    spec: JobSpec,
    model: PlanModel,
    *,
    element_bytes: int = 2,
    limits: Limits | None = None,
    throughput: Throughput | None = None,
    gpu_cost_per_hour: float | None = None,
    deadline_s: float | None = None,
    pages_in_flight: int | None = None,
    prices: S3Prices | None = None,
    hot_max_entry_bytes: int | None = None,
) -> Plan:
    limits = limits or Limits()
    max_new = spec.sampling.max_new_tokens
    per_token = model.kv.bytes_per_token(element_bytes)
    counter = model.prompt_tokens or estimate_prompt_tokens
    prompt_counts = _question_tokens(spec, counter)
    bounds = job_bounds(spec.budget, list(spec.prompts), spec.json_schema, model.geometry)
    effective = bounds or model.geometry.default
    level = resolve_level(spec.budget, list(spec.prompts), spec.json_schema)
    plans = []
    for path in expand_paths(paths):
        survey = survey_source(path, spec.ingest, limits)
        plan = SourcePlan(str(path), survey.kind, error=survey.error, notes=list(survey.notes))
        plan.duration_s = survey.duration
        source_bounds = bounds
        if survey.kind == "video" and survey.sizes and spec.budget.max_tokens_per_video is not None:
            per_frame = model.count_visual_tokens(*survey.sizes[0], bounds)
            source_bounds = video_cap_bounds(
                bounds, len(survey.sizes), per_frame, spec.budget.max_tokens_per_video, model.geometry
            )
        if survey.kind == "video" and spec.budget.skip_redundant_frames:
            plan.notes.append("redundant-frame skipping is on: a run may ask fewer frames (upper bound)")
        window = spec.window_plan()
        if model.window_view_tokens is not None and window is not None and window.size != 1:
            plan.notes.append(
                f"each page or frame is also encoded on the view windows of several show "
                f"({model.window_view_tokens} tokens, budgets aside): counted in visual_to_lm only"
            )
        if spec.budget.drop_static > 0 and spec.window is not None:
            plan.notes.append("--drop-static is on: a run may give the LM fewer visual tokens (upper bound)")
        plan.max_pixels = (source_bounds or model.geometry.default).max_pixels
        visuals: list[int] = []  # per unit that can be encoded
        for width, height in survey.sizes:
            try:
                visual = model.count_visual_tokens(width, height, source_bounds)
            except ValueError as exc:
                plan.notes.append(f"a {width}x{height} unit cannot be encoded: {exc}")
                continue
            if visual > limits.max_visual_tokens:
                plan.notes.append(f"a {width}x{height} unit is over the visual-token limit ({visual})")
                continue
            plan.units += 1
            plan.visual_tokens += visual
            plan.visual_tokens_max = max(plan.visual_tokens_max, visual)
            visuals.append(visual)
        # What each request shows: a unit, or a window's units (encoded once, shown in each window).
        shown = (
            _windowed(visuals, spec, survey.duration, model.window_view_tokens)
            if spec.window is not None
            else visuals
        )
        for visual in shown:
            for prompt_tokens in prompt_counts:
                plan.requests += 1
                plan.prompt_tokens += prompt_tokens
                plan.visual_to_lm += visual
                plan.tokens += visual + prompt_tokens + max_new
        if spec.summarize is not None and shown:
            # One text-only request over the source's answers (each at --max-new-tokens, with
            # its place and question: ~16 tokens); in stages when over the context.
            summary = counter(spec.summarize) + len(shown) * len(prompt_counts) * (max_new + 16)
            plan.requests += 1
            plan.prompt_tokens += summary
            plan.tokens += summary + max_new
        longest = max(shown, default=0) + max(prompt_counts) + max_new
        if spec.window is not None and shown and model.context is not None and longest > model.context:
            plan.over_context = True
            plan.error = (
                f"a window of its pages or frames is {longest:,} tokens with the prompt and "
                f"--max-new-tokens, over the model's context of {model.context:,} tokens"
            )
        if shown:
            plan.kv_bytes_per_request = per_token * (max(shown) + max(prompt_counts) + max_new)
        plans.append(plan)
    total = SourcePlan("total", None)
    for p in plans:
        total.units += p.units
        total.requests += p.requests
        total.visual_tokens += p.visual_tokens
        total.visual_to_lm += p.visual_to_lm
        total.visual_tokens_max = max(total.visual_tokens_max, p.visual_tokens_max)
        total.prompt_tokens += p.prompt_tokens
        total.tokens += p.tokens
        total.kv_bytes_per_request = max(total.kv_bytes_per_request, p.kv_bytes_per_request)
    result = Plan(
        model=model.name,
        detail=level,
        bounds=asdict(effective),
        prompt_tokens_estimated=model.prompt_tokens is None,
        kv_bytes_per_token=per_token,
        dtype_bytes=element_bytes,
        max_new_tokens=max_new,
        prompts=len(spec.prompts),
        sources=plans,
        total=total,
    )
    if level is not None and spec.budget.detail == "auto":
        # The family's own cap for the level (LLaVA-OneVision's presets are grids, not DETAIL_TOKENS).
        most = model.geometry.detail_max_pixels(level) // model.geometry.token_pixels
        result.notes.append(f"--detail auto chose {level} ({most} tokens per image at most)")
    if throughput is not None:
        seconds = (
            total.tokens / throughput.value
            if throughput.unit == "tokens/s"
            else total.requests / throughput.value
        )
        result.throughput = asdict(throughput)
        result.gpu_hours = seconds / 3600
        if gpu_cost_per_hour is not None:
            result.cost_usd = result.gpu_hours * gpu_cost_per_hour
            if total.units:
                result.cost_per_million_pages_usd = result.cost_usd / total.units * 1e6
    elif gpu_cost_per_hour is not None:
        # Said, not silently dropped: a price needs a measured rate (the fleet lines' is assumed).
        result.notes.append("--gpu-cost-per-hour needs --throughput (your measured rate): no cost without it")
    if model.shape is not None and total.units:
        result.fleet = _fleet(result, spec, model.shape, element_bytes, throughput, deadline_s,
                              pages_in_flight, prices, hot_max_entry_bytes)  # fmt: skip
    return result


def _fleet(
    plan: Plan,
    spec: JobSpec,
    shape: ModelShape,
    element_bytes: int,
    throughput: Throughput | None,
    deadline_s: float | None,
    pages_in_flight: int | None,
    prices: S3Prices | None,
    hot_max_entry_bytes: int | None = None,
) -> FleetFigures:
    """The job at fleet scale: GPUs for the deadline, cache bytes, S3 (worker.planning.fleet_sizing)."""
    total = plan.total
    if throughput is None:
        rate = assumed_pages_per_second(
            shape,
            total.tokens / total.requests,
            total.visual_tokens / total.units,
            total.requests / total.units,
        )
        source = THROUGHPUT_SOURCE
    elif throughput.unit == "pages/s":  # requests (a unit asked one prompt) per second
        rate, source = throughput.value * total.units / total.requests, "--throughput"
    else:
        rate, source = throughput.value * total.units / total.tokens, "--throughput"
    return fleet_figures(
        units=total.units,
        visual_tokens=total.visual_tokens,
        visual_tokens_max=total.visual_tokens_max,
        shape=shape,
        element_bytes=element_bytes,
        pages_per_gpu_s=rate,
        throughput_source=source,
        cache_policy=spec.cache,
        deadline_s=deadline_s,
        pages_in_flight=pages_in_flight,
        prices=prices,
        hot_max_entry_bytes=hot_max_entry_bytes,
    )
