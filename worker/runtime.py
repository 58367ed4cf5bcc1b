"""Everything a stage needs, built from settings: database, object store, token cache, model, engine.

Built lazily, so `visbatch status` never loads a model and `visbatch ingest` never loads weights.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from storage.db import Database
from storage.object_store import ObjectStore, open_object_store
from storage.settings import Settings
from storage.token_cache import TokenCache, open_token_cache
from worker.encode import VisualTokenStore
from worker.engines import Engine, make_engine
from worker.models import ModelAdapter, ModelRef, load_adapter


class Runtime:
    def __init__(self, settings: Settings, model: str | None = None) -> None:
        self.settings = settings
        name = model or settings.model
        # A local folder is recorded by its absolute path, so results say which model made them.
        self.model_name = str(Path(name).resolve()) if Path(name).is_dir() else name

    @cached_property
    def db(self) -> Database:
        db = Database(self.settings.sqlalchemy_url())
        db.upgrade()
        return db

    @cached_property
    def store(self) -> ObjectStore:
        return open_object_store(self.settings.object_store_url())

    @cached_property
    def cache(self) -> TokenCache:
        return open_token_cache(self.settings.token_cache_url(), self.settings.cache_max_bytes)

    @cached_property
    def adapter(self) -> ModelAdapter:
        ref = ModelRef(
            source=self.model_name,
            revision=self.settings.model_revision,
            device=self.settings.device,
            dtype=self.settings.dtype,
        )
        return load_adapter(ref)

    @cached_property
    def tokens(self) -> VisualTokenStore:
        return VisualTokenStore(self.adapter, self.cache, self.store, self.settings.encode_batch_images)

    @cached_property
    def engine(self) -> Engine:
        return make_engine(self.settings.engine, self.adapter)

    def close(self) -> None:
        if "db" in self.__dict__:
            self.db.dispose()
