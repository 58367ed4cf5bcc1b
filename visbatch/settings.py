"""Settings from the environment (``VISBATCH_*``), the one place where the shape is chosen.

A stage never asks "am I embedded or in a fleet?": it gets URLs from here and
builds its store, cache and database from them (worker.runtime). Every layer reads settings
(storage, ingest, worker, the CLI and the Python API): this module imports nothing of the
project, and the ``visbatch`` package loads its API only on first use, so reading them here costs
nothing else.

Each setting is declared once, below, with its type, default, bounds and description; a value
comes from a keyword argument, else from ``VISBATCH_<NAME>`` (an empty one counts as unset),
else the default. This is plain Python on purpose: every command reads settings, and importing
pydantic-settings took `visbatch status` a sixth of a second before it had done anything.
"""

from __future__ import annotations

import json
import os
import typing
from functools import cached_property
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"
# $VISBATCH_HOME/config.json: defaults recorded for this folder (`visbatch model use`).
HOME_CONFIG = "config.json"


def home_config_path(home: Path) -> Path:
    return home.expanduser().resolve() / HOME_CONFIG


def read_home_config(home: Path) -> dict[str, Any]:
    """The defaults recorded under `home`; {} when there are none (or the file is unreadable)."""
    try:
        data = json.loads(home_config_path(home).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_home_config(home: Path, **values: Any) -> Path:
    """Record defaults under `home` (a value of None removes it); returns the file."""
    path = home_config_path(home)
    data = read_home_config(home)
    for key, value in values.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


ENV_PREFIX = "VISBATCH_"
_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})
_FALSE = frozenset({"0", "false", "no", "off", "f", "n"})


class SettingError(ValueError):
    """A setting with a value of the wrong type or out of its bounds: names the variable."""


class SecretStr:
    """A secret (an API key): ``repr`` and ``str`` print stars, so a logged Settings never shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "SecretStr('**********')"

    def __str__(self) -> str:
        return "**********"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretStr) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


class Setting:
    """The declaration of one setting (a class attribute of Settings; instances hold values)."""

    def __init__(
        self,
        default: Any,
        *,
        description: str,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
    ) -> None:
        self.default = default
        self.description = description
        self.bounds = (ge, gt, le)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def convert(self, raw: Any, annotation: Any, source: str) -> Any:
        """``raw`` (a string from the environment, or a caller's value) as the declared type."""
        kinds = typing.get_args(annotation) if isinstance(annotation, UnionType) else (annotation,)
        if raw is None and NoneType in kinds:
            return None
        (kind,) = [k for k in kinds if k is not NoneType]
        try:
            value = _as(kind, raw)
        except (TypeError, ValueError):
            raise SettingError(f"{source}={raw!r}: not {_KIND_NAMES.get(kind, kind.__name__)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return value
        ge, gt, le = self.bounds
        if (
            (ge is not None and value < ge)
            or (gt is not None and value <= gt)
            or (le is not None and value > le)
        ):
            rules = [
                f"{op} {bound}" for op, bound in ((">=", ge), (">", gt), ("<=", le)) if bound is not None
            ]
            raise SettingError(f"{source}={raw!r}: must be {' and '.join(rules)}")
        return value


def setting(default: Any, **declaration: Any) -> Any:
    """Declare a setting: a Setting, typed ``Any`` so that ``port: int = setting(9808, ...)``
    type-checks as the int it holds on an instance."""
    return Setting(default, **declaration)


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "text", Path: "a path"}


def _as(kind: type, raw: Any) -> Any:
    """``raw`` as ``kind``: a value of that kind as it is, a string parsed (True is not 1 here)."""
    if isinstance(raw, bool) and kind is not bool:
        raise TypeError(raw)
    if kind is float and isinstance(raw, int):
        return float(raw)
    if isinstance(raw, kind):
        return raw
    if kind is Path and isinstance(raw, os.PathLike):
        return Path(raw)
    if not isinstance(raw, str):
        raise TypeError(raw)
    if kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError(raw)
        return word in _TRUE
    if kind is int or kind is float:
        return kind(raw.strip())
    return kind(raw)  # str, Path, SecretStr


class Settings:
    """What this process runs with: keyword arguments win over ``VISBATCH_*``, which win over the
    defaults. Read once per command; stages get the URLs and numbers they need from it."""

    home: Path = setting(
        Path(".visbatch"), description="Folder for the embedded defaults (db, store, cache)."
    )
    database_url: str | None = setting(None, description="SQLAlchemy URL; default: SQLite under home.")
    store_url: str | None = setting(None, description="Object store URL; default: a folder under home.")
    cache_url: str | None = setting(None, description="Visual-token cache URL; default: a folder under home.")
    cache_max_bytes: int = setting(2 * 1024**3, description="Byte budget of the folder token cache (LRU).")
    # Fleet: cache_url=redis://cache-redis:6379/0 (hot) + cache_cold_url=s3://bucket/prefix (durable).
    cache_cold_url: str | None = setting(
        None, description="Cold token-cache tier (s3://bucket/prefix); with it, cache_url is the hot tier."
    )
    cache_ttl_seconds: int = setting(7 * 24 * 3600, ge=1, description="Expiry of a hot (Redis) cache entry.")
    cache_none_ttl_seconds: int = setting(
        6 * 3600, ge=1, description="Expiry of a hot entry of a --cache none job (deleted once answered)."
    )
    cache_compression: str = setting(
        "none", description="Write token-cache entries compressed: none, or zstd (both kinds always read)."
    )
    cache_hot_max_entry_bytes: int = setting(
        32 * 1024**2, ge=1, description="Entries larger than this are kept in the cold tier only."
    )
    s3_endpoint_url: str | None = setting(
        None, description="S3 API endpoint for a non-AWS store (MinIO, Ceph...); credentials: AWS chain."
    )

    model: str = setting(DEFAULT_MODEL, description="Hub id or local folder of the VLM.")
    model_revision: str | None = setting(None, description="Hub revision (part of every cache key).")
    engine: str = setting(
        "auto",
        description="Generation engine: vllm, transformers, openai (a vLLM server at llm_url), or auto "
        "(vllm where importable, on a GPU); load: capacity tests only (no model compute, fixed answers).",
    )
    device: str = setting("auto", description="torch device: auto, cpu, cuda, cuda:1 ...")
    dtype: str = setting("auto", description="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")

    encode_batch_images: int = setting(8, ge=1, description="Images per vision-tower call.")
    generate_window: int | None = setting(
        None,
        ge=1,
        description="Requests kept in the engine (default: 256 for vLLM, 4 batches for transformers).",
    )
    token_budget: int = setting(
        16384,
        ge=1,
        description="transformers engine: max visual+prompt+new tokens in one padded batch (its cap, "
        "named before 'budget' meant the job's visual-token budget only).",
    )
    max_batch_size: int = setting(16, ge=1, description="transformers engine: max requests in one batch.")

    # --- vLLM engine (VISBATCH_VLLM_*); None leaves vLLM's own default ---------------------
    vllm_max_num_batched_tokens: int | None = setting(
        None, ge=1, description="Tokens vLLM schedules per step (prefill chunking)."
    )
    vllm_max_num_seqs: int | None = setting(None, ge=1, description="Sequences vLLM runs at once.")
    vllm_gpu_memory_utilization: float = setting(
        0.9, gt=0, le=1, description="Share of GPU memory vLLM may take (on CPU: share of host memory)."
    )
    vllm_max_model_len: int | None = setting(None, ge=1, description="Context length (default: the model's).")
    vllm_tensor_parallel_size: int = setting(1, ge=1, description="GPUs one model is split over.")
    vllm_enforce_eager: bool = setting(False, description="Skip graph capture/compilation (faster start).")

    # --- openai engine: a running `vllm serve` (VISBATCH_LLM_*) ----------------------------
    llm_url: str | None = setting(
        None, description="Base URL of the vLLM OpenAI-compatible server, e.g. http://host:8000/v1."
    )
    llm_model: str | None = setting(None, description="Served model name to ask for (default: the server's).")
    # SecretStr: repr and str print '**********', so a logged or printed Settings never shows it.
    llm_api_key: SecretStr | None = setting(
        None, description="Bearer token of the server (its --api-key); default: $OPENAI_API_KEY."
    )
    llm_timeout_s: float = setting(600.0, gt=0, description="Seconds one request may take at the server.")
    llm_max_in_flight: int = setting(
        64, ge=1, description="HTTP requests kept open at the server (each carries its embeddings)."
    )
    llm_max_retries: int = setting(5, ge=0, description="Retries of a timeout, connection error, 429 or 5xx.")
    llm_server_plugin: bool = setting(
        False,
        description="The server runs where visbatch is installed, so its vLLM plugin is loaded there "
        "and the openai engine takes LLaVA-OneVision, InternVL and Idefics3.",
    )

    # --- load engine: capacity tests only (worker/engines/load_engine.py, VISBATCH_LOAD_*) ----
    load_tokens_per_s: float = setting(
        20_000.0, gt=0, description="load engine (capacity tests only): tokens/s of the emulated GPU."
    )
    load_output_tokens: int = setting(
        8, ge=1, description="load engine (capacity tests only): new tokens per answer (<= max_new_tokens)."
    )
    load_request_tokens: int | None = setting(
        None, ge=1, description="load engine (capacity tests only): tokens a request costs (default: own)."
    )

    # --- input limits (defaults in ingest/limits.py; None keeps the default) -----------------
    limit_max_source_bytes: int | None = setting(None, ge=1, description="Bytes per source file.")
    limit_max_pdf_pages: int | None = setting(None, ge=1, description="Pages selected from one PDF.")
    limit_max_video_seconds: float | None = setting(None, gt=0, description="Duration of one video.")
    limit_max_image_pixels: int | None = setting(None, ge=1, description="Decoded pixels of one image.")
    limit_max_render_pixels: int | None = setting(None, ge=1, description="Pixels of one page render.")
    limit_max_visual_tokens: int | None = setting(None, ge=1, description="Visual tokens of one page/frame.")
    limit_unit_timeout_s: float | None = setting(
        None, gt=0, description="Seconds per page render/frame decode."
    )
    limit_memory_bytes: int | None = setting(
        None, ge=1, description="Address space of the splitting process."
    )
    ingest_workers: int = setting(2, ge=1, le=64, description="Sources split in parallel (embedded run).")
    ingest_processes: int | None = setting(
        None,
        ge=1,
        le=256,
        description="Processes the pages of one PDF are spread over (default: the cores / ingest_workers; "
        "a fleet ingest worker: 1, its pool already fills the cores).",
    )

    # --- fleet (Celery on RabbitMQ or Redis) ------------------------------------------------
    broker_url: str = setting(
        "redis://127.0.0.1:6379/0",
        description="Celery broker: amqp://... (RabbitMQ, recommended) or redis://... (never evicting).",
    )
    broker_prefix: str = setting(
        "", description="Prefix of every broker key (Redis) or queue name (RabbitMQ): several fleets on one."
    )
    # Tasks are kept short (ingest by page range, generate by unit) so that a dead worker's work
    # is redone within about two minutes on Redis too, which only redelivers after the visibility
    # timeout (plus up to one restore interval): 100 + 5 s, measured ~110 s (docs/reliability.md).
    task_time_limit: int = setting(90, ge=1, description="Hard time limit of one task, seconds.")
    visibility_timeout: int = setting(
        100, ge=1, description="Seconds before Redis hands an unacked task to another worker (> time limit)."
    )
    metrics_port: int = setting(9808, ge=0, le=65535, description="Port of a worker's Prometheus metrics.")
    ingest_range_units: int = setting(
        128, ge=1, description="Pages of a PDF one fleet ingest task renders before handing the rest on."
    )
    unacked_restore_interval: int = setting(
        5, ge=1, description="Seconds between sweeps for abandoned tasks."
    )
    # The safety net for a job whose messages were lost anyway (worker.drivers.fleet.stall_watch).
    stall_after_s: int = setting(
        120,
        ge=10,
        description="A running fleet job with work left, no progress for this long and no message "
        "waiting for it is resumed by the fleet itself.",
    )
    stall_check_s: float = setting(
        30.0, gt=0, description="Seconds between a worker's looks for stalled jobs (jittered)."
    )
    # How a job run in one process is known to be alive, wherever it runs (storage.leases): renewed
    # every sixth of this, so a database that pauses for a few seconds never expires a live run.
    lease_s: float = setting(
        30.0,
        ge=3,
        description="Seconds a run's lease on its job lasts; a job whose run stopped renewing it "
        "this long is interrupted, and `visbatch resume` may take it over.",
    )
    # 8 retries, backoff 1, 2, 4 ... 60 s with jitter: 1.5-4.5 min, so a database or broker restart
    # (seconds to a couple of minutes) never fails a unit; a longer outage does, with its cause.
    task_max_retries: int = setting(8, ge=0, description="Retries of a transient error before a unit fails.")
    encode_chunk_units: int = setting(16, ge=1, description="Units per encode task.")
    # Capacity tests only (bench/unit_costs.py, bench/control_plane.py): read once by storage.usage.
    usage_dir: Path | None = setting(
        None,
        description="Capacity tests only: count SQL statements and task messages per process "
        "into <dir>/<pid>.json (off when unset).",
    )

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(unknown)}")
        hints = _HINTS
        # Where each setting not left at its default came from: "VISBATCH_<NAME>" or the keyword.
        given: dict[str, str] = {}
        for name, declared in SETTINGS.items():
            if name in values:
                value = declared.convert(values[name], hints[name], name)
                given[name] = name
            elif os.environ.get(declared.env, "") != "":
                value = declared.convert(os.environ[declared.env], hints[name], declared.env)
                given[name] = declared.env
            else:
                value = declared.default
            setattr(self, name, value)
        self._given = given
        # Where `model` came from: "VISBATCH_MODEL" (or a caller), "<home>/config.json", or "default".
        self._model_origin = "default"
        if "model" in given:
            self._model_origin = "VISBATCH_MODEL"
        else:
            # The model this folder was told to use (`visbatch model use`, e.g. by `make run
            # MODEL=tiny`), so a plain `visbatch run` does not reach for the hub after the tiny
            # model was chosen.
            recorded = read_home_config(self.home).get("model")
            if isinstance(recorded, str) and recorded.strip():
                self.model = recorded
                self._model_origin = str(home_config_path(self.home))

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in SETTINGS)
        return f"Settings({shown})"

    @property
    def model_origin(self) -> str:
        return self._model_origin

    @cached_property
    def resolved_home(self) -> Path:
        return self.home.expanduser().resolve()

    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.resolved_home / 'visbatch.db'}"

    @property
    def database_chosen_by(self) -> str:
        """What chose the database: "VISBATCH_DATABASE_URL", "VISBATCH_HOME" (or the keyword
        argument's name), or "" when both were left unset (the current folder's .visbatch)."""
        if self.database_url:
            return self._given.get("database_url", "database_url")
        return self._given.get("home", "")

    def database_origin(self) -> str:
        """How `sqlalchemy_url` was found, in words an error can show: state depends on the
        variables and on the folder a command runs in, so a message about the database says which."""
        chosen_by = self.database_chosen_by
        if self.database_url:
            return f"from {chosen_by}"
        if chosen_by:
            return f"under {chosen_by}={self.home}; VISBATCH_DATABASE_URL unset"
        return "the current folder's .visbatch: VISBATCH_HOME and VISBATCH_DATABASE_URL unset"

    def object_store_url(self) -> str:
        return self.store_url or f"file://{self.resolved_home / 'store'}"

    def token_cache_url(self) -> str:
        return self.cache_url or f"file://{self.resolved_home / 'token-cache'}"


# Every declared setting, by name, in declaration order.
SETTINGS: dict[str, Setting] = {
    name: value for name, value in vars(Settings).items() if isinstance(value, Setting)
}

# Their declared types (the annotations are strings under `from __future__ import annotations`).
_HINTS: dict[str, Any] = typing.get_type_hints(Settings)
