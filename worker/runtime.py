"""Everything a stage needs, built from settings: database, object store, token cache, model, engine.

Built lazily, and the heavy parts imported lazily too: `visbatch status`, an ingest worker and
the ingest stage never import torch or transformers; only encode and generate load the model.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from ingest.limits import Limits
from storage.db import Database
from storage.settings import Settings

if TYPE_CHECKING:
    from ingest.isolation import IsolatedSplitter
    from ingest.token_rules import TokenRule
    from storage.object_store import ObjectStore
    from storage.token_cache import TokenCache
    from worker.engines import Engine
    from worker.models import ModelAdapter
    from worker.request_builder import RequestBuilder
    from worker.retry import RetryPolicy
    from worker.token_store import VisualTokenStore


def resolve_model_name(name: str) -> str:
    """A local folder is recorded by its absolute path, so results say which model made them."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


class Runtime:
    def __init__(self, settings: Settings, model: str | None = None, db: Database | None = None) -> None:
        self.settings = settings
        self._owns_db = db is None
        if db is not None:  # shared by the runtimes of a worker process: not ours to close
            self.__dict__["db"] = db
        self._local = threading.local()
        self._lock = threading.Lock()
        self._splitters: list[IsolatedSplitter] = []
        self.model_name = resolve_model_name(model or settings.model)
        # Processes one splitting child spreads a PDF's pages over (ingest.spread).
        cores = os.cpu_count() or 1
        self.split_processes = settings.ingest_processes or max(1, cores // settings.ingest_workers)

    @cached_property
    def db(self) -> Database:
        db = Database(self.settings.sqlalchemy_url())
        db.ensure_schema()
        return db

    @cached_property
    def store(self) -> ObjectStore:
        from storage.object_store import open_object_store

        return open_object_store(self.settings.object_store_url(), endpoint_url=self.settings.s3_endpoint_url)

    @cached_property
    def cache(self) -> TokenCache:
        from storage.token_cache import open_token_cache

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

    @cached_property
    def retry(self) -> RetryPolicy:
        from worker.retry import RetryPolicy

        return RetryPolicy(max_retries=self.settings.task_max_retries)

    @cached_property
    def token_rule(self) -> TokenRule:
        """The model's token rule from its JSON files: what ingest needs of the model (no torch)."""
        from ingest.token_rules import load_token_rule

        return load_token_rule(self.model_name, self.settings.model_revision)

    def splitter(self) -> IsolatedSplitter:
        """This thread's splitting process (started on first use, replaced when it dies)."""
        splitter = getattr(self._local, "splitter", None)
        if splitter is None:
            from ingest.isolation import IsolatedSplitter

            splitter = IsolatedSplitter(
                self.settings.object_store_url(),
                endpoint_url=self.settings.s3_endpoint_url,
                limits=self.limits,
                processes=self.split_processes,
            )
            self._local.splitter = splitter
            with self._lock:
                self._splitters.append(splitter)
        return splitter

    @cached_property
    def engine_name(self) -> str:
        """vllm, transformers or openai: what `VISBATCH_ENGINE` means for this model on this machine."""
        from worker.engines import resolve_engine_name

        return resolve_engine_name(self.settings.engine, self.adapter)

    @cached_property
    def adapter(self) -> ModelAdapter:
        from worker.models import ModelRef, load_adapter

        ref = ModelRef(
            source=self.model_name,
            revision=self.settings.model_revision,
            device=self.settings.device,
            dtype=self.settings.dtype,
        )
        adapter = load_adapter(ref)
        from worker.engines import resolve_engine_name

        adapter.vision_only = resolve_engine_name(self.settings.engine, adapter) != "transformers"
        return adapter

    @cached_property
    def tokens(self) -> VisualTokenStore:
        from worker.token_store import VisualTokenStore

        return VisualTokenStore(self.adapter, self.cache, self.store, self.settings.encode_batch_images)

    @cached_property
    def engine(self) -> Engine:
        from worker.engines import make_engine

        return make_engine(self.settings.engine, self.adapter, self.settings)

    @cached_property
    def requests(self) -> RequestBuilder:
        from worker.request_builder import RequestBuilder

        return RequestBuilder(
            self.adapter, self.tokens, model_name=self.model_name, engine_name=self.engine.name
        )

    def warm_up(self) -> None:
        """Load what encode and generate need (weights, the engine) now: an embedded run does it
        beside ingest, so the first page finds the model ready instead of waiting for it."""
        engine = self.engine
        _ = self.requests, self.tokens
        if self.adapter.vision_only:  # another engine generates: the tower alone, and that engine
            _ = getattr(self.adapter, "vision_tower", None)
            _ = getattr(engine, "llm", None)
        else:
            _ = self.adapter.model

    @property
    def generate_window(self) -> int:
        """Requests kept in flight in the engine (VISBATCH_GENERATE_WINDOW; default by engine)."""
        if self.settings.generate_window is not None:
            return self.settings.generate_window
        # vLLM schedules hundreds of sequences at once (Ray Data LLM keeps 256 per replica), in
        # process or as a server; transformers runs static batches, so a few batches' worth to pack from.
        return 256 if self.engine.name in ("vllm", "openai") else 4 * self.settings.max_batch_size

    def kill_splitters(self) -> None:
        """Kill every splitting child (from any thread): a stopping run ends its renders at once."""
        for splitter in self._all_splitters():
            splitter.kill()

    def close_splitters(self) -> None:
        """Kill and close every splitting child, once no thread reads from them (the run's end)."""
        for splitter in self._all_splitters():
            splitter.close()

    def _all_splitters(self) -> list[IsolatedSplitter]:
        with self._lock:
            return list(self._splitters)

    def close(self) -> None:
        self.close_splitters()
        if self._owns_db and "db" in self.__dict__:
            self.db.dispose()
