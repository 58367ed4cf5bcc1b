"""Settings from the environment (``VISBATCH_*``), the one place where the shape is chosen.

A stage never asks "am I embedded or in a fleet?": it gets URLs from here and
builds its store, cache and database from them (see ``storage.factory``).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VISBATCH_", extra="ignore")

    home: Path = Field(Path(".visbatch"), description="Folder for the embedded defaults (db, store, cache).")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite under home.")
    store_url: str | None = Field(None, description="Object store URL; default: a folder under home.")
    cache_url: str | None = Field(None, description="Visual-token cache URL; default: a folder under home.")
    cache_max_bytes: int = Field(2 * 1024**3, description="Byte budget of the folder token cache (LRU).")

    model: str = Field(DEFAULT_MODEL, description="Hub id or local folder of the VLM.")
    model_revision: str | None = Field(None, description="Hub revision (part of every cache key).")
    engine: str = Field("transformers", description="Generation engine.")
    device: str = Field("auto", description="torch device: auto, cpu, cuda, cuda:1 ...")
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.")

    encode_batch_images: int = Field(8, description="Images per vision-tower call.")
    token_budget: int = Field(16384, description="Max visual+prompt+new tokens in one generate batch.")
    max_batch_size: int = Field(16, description="Max requests in one generate batch.")

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
