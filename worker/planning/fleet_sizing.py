"""Fleet-level sizing: GPUs for a deadline, token-cache bytes (hot and cold), S3 requests and cost.

Pure arithmetic over a model's config and a job's token counts (no torch, no services): used by
`visbatch plan` (worker.planning.planner) and by the worker's hot-tier check at start
(worker.planning.cache_check).
Every assumed figure is named here with its source; docs/scale.md derives its tables from these.

**Cache entry** (worker.tokens.tensors): tokens x hidden x bytes per element, plus the same again
per extra layer the family caches (Qwen3-VL's deepstack maps), plus a safetensors header.

**Hot tier** (Redis) must hold every page in flight, or pages are evicted between encode and
generate and their tower runs twice:

    hot bytes = GPUs x pages in flight per GPU x bytes per page x safety factor
    pages in flight per GPU = generate task threads (`visbatch worker --concurrency`, default
        VISBATCH_GENERATE_WINDOW or 64: one unit per message, prefetch 1 per thread)
        + one encode message's units (VISBATCH_ENCODE_CHUNK_UNITS, 16) being written
    safety factor 2: Redis' LRU is sampled (an entry in use can go before an idle one), and
        allocator fragmentation and per-key overhead come on top of the values

plus the generate queue's backlog (units encoded, waiting for a GPU: the `visbatch_queue_depth_messages`
metric) when encode runs ahead of generate.

**Throughput** when none is measured: prefill-dominated FLOPs per page, 2 x LM parameters x
(visual + prompt + new tokens) + 2 x tower parameters x the patches the tower sees, at an
assumed 25% of an H100 SXM's dense bf16 peak (989 TFLOP/s, NVIDIA H100 Tensor Core GPU
datasheet). ASSUMED, not measured: pass `--throughput` with your own figure.

**S3** prices (AWS S3 Standard, us-east-1 public list prices, https://aws.amazon.com/s3/pricing/):
$0.023 per GB-month (first 50 TB; $0.022 to 500 TB, $0.021 above), $0.005 per 1,000 PUT and
$0.0004 per 1,000 GET requests. Overridable on the command line.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

# --- stated assumptions --------------------------------------------------------------------------

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, dense BF16 Tensor Core
ASSUMED_MFU = 0.25  # share of that peak a batched VLM job keeps (prefill-heavy, short answers)
THROUGHPUT_SOURCE = (
    f"assumed: {ASSUMED_MFU:.0%} of an H100 SXM's {H100_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s dense bf16 "
    "(NVIDIA datasheet) over the model's FLOPs per page; measure yours and pass --throughput"
)
S3_USD_PER_GB_MONTH = 0.023  # S3 Standard, first 50 TB/month, us-east-1
S3_USD_PER_1000_PUT = 0.005  # PUT, COPY, POST, LIST
S3_USD_PER_1000_GET = 0.0004  # GET, SELECT and all other requests
S3_PRICE_SOURCE = "AWS S3 Standard, us-east-1 public list prices (aws.amazon.com/s3/pricing)"
HOT_SAFETY_FACTOR = 2.0
DEFAULT_GENERATE_THREADS = 64  # `visbatch worker` task threads without VISBATCH_GENERATE_WINDOW
SAFETENSORS_HEADER_BYTES = 300  # the JSON header of one entry (names, shapes, offsets, fingerprint)
GB = 1e9  # S3 bills decimal gigabytes


# --- the model's shape ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs of a model, from its config.json alone."""

    cache_width: int  # elements per visual token in a cache entry (hidden x (1 + extra layers))
    lm_params: float  # parameters one token goes through in the LM (active ones for MoE)
    tower_params: float  # vision tower parameters
    patches_per_token: int  # patches the tower sees per visual token (the merge)


def model_shape(config: dict[str, Any]) -> ModelShape:
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}
    hidden = int(text["hidden_size"])
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    layers = int(text.get("num_hidden_layers") or 0)
    if text.get("num_experts_per_tok") and text.get("moe_intermediate_size"):
        mlp = 3 * hidden * int(text["moe_intermediate_size"]) * int(text["num_experts_per_tok"])
    else:
        mlp = 3 * hidden * int(text.get("intermediate_size") or 4 * hidden)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    lm_params = float(layers * (attention + mlp))
    width = int(vision.get("embed_dim") or vision.get("hidden_size") or 0)
    depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 0)
    inner = int(vision.get("intermediate_size") or width * float(vision.get("mlp_ratio") or 4))
    tower_params = float(depth * (4 * width * width + 2 * width * inner))
    if "spatial_merge_size" in vision:
        patches = int(vision["spatial_merge_size"]) ** 2
    elif config.get("downsample_ratio"):  # InternVL: the pixel shuffle, 0.5 -> 4 patches a token
        patches = round(1 / float(config["downsample_ratio"]) ** 2)
    else:
        patches = int(config.get("scale_factor") or 1) ** 2  # Idefics3: the pixel shuffle
    extra_layers = len(vision.get("deepstack_visual_indexes") or [])
    return ModelShape(hidden * (1 + extra_layers), lm_params, tower_params, patches)


def entry_bytes(visual_tokens: int, shape: ModelShape, element_bytes: int) -> int:
    """Bytes of one cache entry (uncompressed safetensors) of an image of `visual_tokens`."""
    return visual_tokens * shape.cache_width * element_bytes + 3 * 8 + SAFETENSORS_HEADER_BYTES


def assumed_pages_per_second(shape: ModelShape, tokens_per_request: float, visual_per_unit: float,
                             requests_per_unit: float) -> float:  # fmt: skip
    """Pages (units) per second on one GPU by the stated FLOPs assumption (THROUGHPUT_SOURCE)."""
    flops = (
        2 * shape.lm_params * tokens_per_request * requests_per_unit
        + 2 * shape.tower_params * visual_per_unit * shape.patches_per_token
    )
    return H100_BF16_DENSE_FLOPS * ASSUMED_MFU / flops if flops > 0 else 0.0


# --- the hot tier --------------------------------------------------------------------------------


def pages_in_flight_per_gpu(generate_threads: int | None = None, encode_chunk_units: int = 16) -> int:
    """Units a GPU worker holds between encode and its stored answers (see the module doc)."""
    return (generate_threads or DEFAULT_GENERATE_THREADS) + encode_chunk_units


def hot_tier_bytes(
    bytes_per_page: float, gpus: int, pages_in_flight: int, safety: float = HOT_SAFETY_FACTOR
) -> int:
    return math.ceil(gpus * pages_in_flight * bytes_per_page * safety)


# --- deadlines -----------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*$", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """`90m`, `24h`, `2d`, `1w` or seconds (`3600`) -> seconds; ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 90m, 24h, 2d)")
    seconds = float(match.group(1)) * _SECONDS[(match.group(2) or "s").lower()]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


def gpus_for(gpu_seconds: float, deadline_s: float) -> int:
    """GPUs that do `gpu_seconds` of work within the deadline (at least one)."""
    return max(1, math.ceil(gpu_seconds / deadline_s - 1e-9))


# --- S3 ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Prices:
    usd_per_gb_month: float = S3_USD_PER_GB_MONTH
    usd_per_1000_put: float = S3_USD_PER_1000_PUT
    usd_per_1000_get: float = S3_USD_PER_1000_GET
    source: str = S3_PRICE_SOURCE


@dataclass
class FleetFigures:
    """A planned job at fleet scale (worker.planning.planner.Plan.fleet)."""

    cache_policy: str
    pages: int
    pages_per_gpu_s: float
    throughput_source: str
    gpu_hours: float
    deadline_s: float | None
    gpus: int
    pages_in_flight_per_gpu: int
    entry_bytes_mean: float
    entry_bytes_max: int
    hot_bytes: int  # Redis memory for the pages in flight, safety factor included
    cold_bytes: int  # S3 bytes of the job's cached tokens (0 unless policy cold)
    s3_put: int
    s3_get: int
    s3_storage_usd_month: float
    s3_requests_usd: float
    prices: dict[str, Any]
    notes: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fleet_figures(
    *,
    units: int,
    visual_tokens: int,
    visual_tokens_max: int,
    shape: ModelShape,
    element_bytes: int,
    pages_per_gpu_s: float,
    throughput_source: str,
    cache_policy: str = "cold",
    deadline_s: float | None = None,
    pages_in_flight: int | None = None,
    prices: S3Prices | None = None,
    hot_max_entry_bytes: int | None = None,
) -> FleetFigures:
    """GPUs for the deadline, hot and cold cache bytes, S3 requests and cost of a job of `units`
    pages/frames with `visual_tokens` in all.

    S3 requests counted per page (what the code does): the page image, 1 PUT (ingest) + 1 GET
    (encode); the token cache under policy cold, 1 GET (the encode lookup, a miss on a new page)
    + 1 PUT (the entry); generate reads Redis (an S3 GET only when Redis lost the entry: 0 with a
    hot tier sized by this plan). Policies hot and none send the cache no S3 request at all.
    """
    prices = prices or S3Prices()
    in_flight = pages_in_flight or pages_in_flight_per_gpu()
    gpu_seconds = units / pages_per_gpu_s if pages_per_gpu_s > 0 else 0.0
    gpus = gpus_for(gpu_seconds, deadline_s) if deadline_s else 1
    total_bytes = visual_tokens * shape.cache_width * element_bytes + units * (
        3 * 8 + SAFETENSORS_HEADER_BYTES
    )
    mean = total_bytes / units if units else 0.0
    biggest = entry_bytes(visual_tokens_max, shape, element_bytes) if units else 0
    cold = total_bytes if cache_policy == "cold" else 0
    put = units + (units if cache_policy == "cold" else 0)
    get = units + (units if cache_policy == "cold" else 0)
    notes = []
    if deadline_s is None:
        notes.append("no --deadline: GPU figures for one GPU")
    if cache_policy != "cold":
        notes.append(f"--cache {cache_policy}: nothing kept in S3; a rerun encodes every page again")
    if hot_max_entry_bytes is not None and mean > hot_max_entry_bytes:
        notes.append(
            f"a page's entry ({mean / 1e6:,.1f} MB) is over VISBATCH_CACHE_HOT_MAX_ENTRY_BYTES "
            f"({hot_max_entry_bytes / 1e6:,.1f} MB): pages would skip Redis; raise it"
        )
    notes.append("page images (PNG, stored once per distinct page) are not in the S3 bytes")
    return FleetFigures(
        cache_policy=cache_policy,
        pages=units,
        pages_per_gpu_s=pages_per_gpu_s,
        throughput_source=throughput_source,
        gpu_hours=gpu_seconds / 3600,
        deadline_s=deadline_s,
        gpus=gpus,
        pages_in_flight_per_gpu=in_flight,
        entry_bytes_mean=mean,
        entry_bytes_max=biggest,
        hot_bytes=hot_tier_bytes(mean, gpus, in_flight),
        cold_bytes=cold,
        s3_put=put,
        s3_get=get,
        s3_storage_usd_month=cold / GB * prices.usd_per_gb_month,
        s3_requests_usd=put / 1000 * prices.usd_per_1000_put + get / 1000 * prices.usd_per_1000_get,
        prices=asdict(prices),
        notes=notes,
    )
