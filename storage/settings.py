"""Settings from the environment (``VISBATCH_*``), the one place where the shape is chosen.

A stage never asks "am I embedded or in a fleet?": it gets URLs from here and
builds its store, cache and database from them (see ``storage.factory``).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VISBATCH_", extra="ignore")

    home: Path = Field(Path(".visbatch"), description="Folder for the embedded defaults (db, store, cache).")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite under home.")
    store_url: str | None = Field(None, description="Object store URL; default: a folder under home.")
    cache_url: str | None = Field(None, description="Visual-token cache URL; default: a folder under home.")
    cache_max_bytes: int = Field(2 * 1024**3, description="Byte budget of the folder token cache (LRU).")
    # Fleet: cache_url=redis://cache-redis:6379/0 (hot) + cache_cold_url=s3://bucket/prefix (durable).
    cache_cold_url: str | None = Field(
        None, description="Cold token-cache tier (s3://bucket/prefix); with it, cache_url is the hot tier."
    )
    cache_ttl_seconds: int = Field(7 * 24 * 3600, ge=1, description="Expiry of a hot (Redis) cache entry.")
    cache_hot_max_entry_bytes: int = Field(
        32 * 1024**2, ge=1, description="Entries larger than this are kept in the cold tier only."
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3 API endpoint for a non-AWS store (MinIO, Ceph...); credentials: AWS chain."
    )

    model: str = Field(DEFAULT_MODEL, description="Hub id or local folder of the VLM.")
    model_revision: str | None = Field(None, description="Hub revision (part of every cache key).")
    engine: str = Field(
        "auto",
        description="Generation engine: vllm, transformers, openai (a vLLM server at llm_url), or auto "
        "(vllm where importable, on a GPU).",
    )
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:1 ...")
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")

    encode_batch_images: int = Field(8, ge=1, description="Images per vision-tower call.")
    generate_window: int | None = Field(
        None,
        ge=1,
        description="Requests kept in the engine (default: 256 for vLLM, 4 batches for transformers).",
    )
    token_budget: int = Field(
        16384, ge=1, description="transformers engine: max visual+prompt+new tokens in one batch."
    )
    max_batch_size: int = Field(16, ge=1, description="transformers engine: max requests in one batch.")

    # --- vLLM engine (VISBATCH_VLLM_*); None leaves vLLM's own default ---------------------
    vllm_max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Tokens vLLM schedules per step (prefill chunking)."
    )
    vllm_max_num_seqs: int | None = Field(None, ge=1, description="Sequences vLLM runs at once.")
    vllm_gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory vLLM may take (on CPU: share of host memory)."
    )
    vllm_max_model_len: int | None = Field(None, ge=1, description="Context length (default: the model's).")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split over.")
    vllm_enforce_eager: bool = Field(False, description="Skip graph capture/compilation (faster start).")

    # --- openai engine: a running `vllm serve` (VISBATCH_LLM_*) ----------------------------
    llm_url: str | None = Field(
        None, description="Base URL of the vLLM OpenAI-compatible server, e.g. http://host:8000/v1."
    )
    llm_model: str | None = Field(None, description="Served model name to ask for (default: the server's).")
    # SecretStr: repr and str print '**********', so a logged or printed Settings never shows it.
    llm_api_key: SecretStr | None = Field(
        None, description="Bearer token of the server (its --api-key); default: $OPENAI_API_KEY."
    )
    llm_timeout_s: float = Field(600.0, gt=0, description="Seconds one request may take at the server.")
    llm_max_in_flight: int = Field(
        64, ge=1, description="HTTP requests kept open at the server (each carries its embeddings)."
    )
    llm_max_retries: int = Field(5, ge=0, description="Retries of a timeout, connection error, 429 or 5xx.")

    # --- input limits (defaults in ingest/limits.py; None keeps the default) -----------------
    limit_max_source_bytes: int | None = Field(None, ge=1, description="Bytes per source file.")
    limit_max_pdf_pages: int | None = Field(None, ge=1, description="Pages selected from one PDF.")
    limit_max_video_seconds: float | None = Field(None, gt=0, description="Duration of one video.")
    limit_max_image_pixels: int | None = Field(None, ge=1, description="Decoded pixels of one image.")
    limit_max_render_pixels: int | None = Field(None, ge=1, description="Pixels of one page render.")
    limit_max_visual_tokens: int | None = Field(None, ge=1, description="Visual tokens of one page/frame.")
    limit_unit_timeout_s: float | None = Field(
        None, gt=0, description="Seconds per page render/frame decode."
    )
    limit_memory_bytes: int | None = Field(None, ge=1, description="Address space of the splitting process.")
    ingest_workers: int = Field(2, ge=1, le=64, description="Sources split in parallel (embedded run).")
    ingest_processes: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Processes the pages of one PDF are spread over (default: the cores / ingest_workers; "
        "a fleet ingest worker: 1, its pool already fills the cores).",
    )

    # --- fleet (Celery on RabbitMQ or Redis) ------------------------------------------------
    broker_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Celery broker: amqp://... (RabbitMQ, recommended) or redis://... (never evicting).",
    )
    broker_prefix: str = Field(
        "", description="Prefix of every broker key (Redis) or queue name (RabbitMQ): several fleets on one."
    )
    # Tasks are kept short (ingest by page range, generate by unit) so that a dead worker's work
    # is redone within minutes on Redis too, which only redelivers after the visibility timeout.
    task_time_limit: int = Field(180, ge=1, description="Hard time limit of one task, seconds.")
    visibility_timeout: int = Field(
        240, ge=1, description="Seconds before Redis hands an unacked task to another worker (> time limit)."
    )
    metrics_port: int = Field(9808, ge=0, le=65535, description="Port of a worker's Prometheus metrics.")
    ingest_range_units: int = Field(
        128, ge=1, description="Pages of a PDF one fleet ingest task renders before handing the rest on."
    )
    unacked_restore_interval: int = Field(10, ge=1, description="Seconds between sweeps for abandoned tasks.")
    task_max_retries: int = Field(5, ge=0, description="Retries of a transient error before a unit fails.")
    encode_chunk_units: int = Field(16, ge=1, description="Units per encode task.")

    # Where `model` came from: "VISBATCH_MODEL" (or a caller), "<home>/config.json", or "default".
    _model_origin: str = PrivateAttr("default")

    @model_validator(mode="after")
    def _recorded_model(self) -> Settings:
        # The environment (or a caller) wins; else the model this folder was told to use (`visbatch
        # model use`, e.g. by `make run MODEL=tiny`), so a plain `visbatch run` does not reach for
        # the hub after the tiny model was chosen.
        if "model" in self.model_fields_set:
            self._model_origin = "VISBATCH_MODEL"
            return self
        recorded = read_home_config(self.home).get("model")
        if isinstance(recorded, str) and recorded.strip():
            self.model = recorded
            self._model_origin = str(home_config_path(self.home))
        return self

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

    def object_store_url(self) -> str:
        return self.store_url or f"file://{self.resolved_home / 'store'}"

    def token_cache_url(self) -> str:
        return self.cache_url or f"file://{self.resolved_home / 'token-cache'}"
