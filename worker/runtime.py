"""Everything a stage needs, built from settings: database, object store, token cache, model, engine.

Built lazily, so `visbatch status` never loads a model and `visbatch ingest` never loads weights.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path

from ingest.isolation import IsolatedSplitter
from ingest.limits import Limits
from storage.db import Database
from storage.object_store import ObjectStore, open_object_store
from storage.settings import Settings
from storage.token_cache import TokenCache, open_token_cache
from worker.encode import VisualTokenStore
from worker.engines import Engine, make_engine, resolve_engine_name
from worker.generate import GenerateStage
from worker.models import ModelAdapter, ModelRef, load_adapter


class Runtime:
    def __init__(self, settings: Settings, model: str | None = None, db: Database | None = None) -> None:
        self.settings = settings
        self._owns_db = db is None
        if db is not None:  # shared by the runtimes of a worker process: not ours to close
            self.__dict__["db"] = db
        self._local = threading.local()
        self._lock = threading.Lock()
        self._splitters: list[IsolatedSplitter] = []
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
        return open_object_store(self.settings.object_store_url(), endpoint_url=self.settings.s3_endpoint_url)

    @cached_property
    def cache(self) -> TokenCache:
        s = self.settings
        return open_token_cache(
            s.token_cache_url(),
            s.cache_max_bytes,
            cold_url=s.cache_cold_url,
            endpoint_url=s.s3_endpoint_url,
            ttl_seconds=s.cache_ttl_seconds,
            hot_max_entry_bytes=s.cache_hot_max_entry_bytes,
        )

    @cached_property
    def limits(self) -> Limits:
        return Limits.from_settings(self.settings)

    def splitter(self) -> IsolatedSplitter:
        """This thread's splitting process (started on first use, replaced when it dies)."""
        splitter = getattr(self._local, "splitter", None)
        if splitter is None:
            splitter = IsolatedSplitter(
                self.settings.object_store_url(),
                endpoint_url=self.settings.s3_endpoint_url,
                limits=self.limits,
            )
            self._local.splitter = splitter
            with self._lock:
                self._splitters.append(splitter)
        return splitter

    @cached_property
    def adapter(self) -> ModelAdapter:
        ref = ModelRef(
            source=self.model_name,
            revision=self.settings.model_revision,
            device=self.settings.device,
            dtype=self.settings.dtype,
        )
        adapter = load_adapter(ref)
        adapter.vision_only = resolve_engine_name(self.settings.engine, adapter) != "transformers"
        return adapter

    @cached_property
    def tokens(self) -> VisualTokenStore:
        return VisualTokenStore(self.adapter, self.cache, self.store, self.settings.encode_batch_images)

    @cached_property
    def engine(self) -> Engine:
        return make_engine(self.settings.engine, self.adapter, self.settings)

    @cached_property
    def generate_stage(self) -> GenerateStage:
        return GenerateStage(
            self.adapter,
            self.engine,
            self.tokens,
            token_budget=self.settings.token_budget,
            max_batch_size=self.settings.max_batch_size,
            model_name=self.model_name,
        )

    def close(self) -> None:
        for splitter in self._splitters:
            splitter.close()
        if self._owns_db and "db" in self.__dict__:
            self.db.dispose()
