"""Everything a stage needs, built from settings: database, object store, token cache, model, engine.

Built lazily, and the heavy parts imported lazily too: `visbatch status`, an ingest worker and
the ingest stage never import torch or transformers; only encode and generate load the model.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ingest.limits import Limits
from storage.db import Database, Migrated, open_existing
from storage.errors import TransientFault, describe
from visbatch.settings import Settings

if TYPE_CHECKING:
    from ingest.isolation import IsolatedSplitter
    from ingest.token_rules import TokenRule
    from storage.object_store import ObjectStore
    from storage.token_cache import TokenCache
    from worker.engines import Engine
    from worker.models import ModelAdapter
    from worker.retry import RetryPolicy
    from worker.stages.generate.requests import RequestBuilder
    from worker.tokens.store import VisualTokenStore


# One per process, shared by every runtime and task thread: transformers' lazy module imports and
# from_pretrained are not safe from several threads at once on a cold process (a burst of messages
# to a fresh worker failed pages with "cannot import name 'AutoProcessor' from 'transformers'").
_LOAD_LOCK = threading.RLock()
T = TypeVar("T")


class ModelUnavailable(TransientFault):
    """This process could not load its model, processor or engine (the cause in the message).

    The worker's failure, never the units': transient (storage.errors.is_transient), so a task's
    message goes back to the broker instead of failing its pages."""


class _LoadedOnce(Generic[T]):
    """A cached_property computed under the process's load lock: exactly once, whichever thread
    asks first (Python 3.12's cached_property has no lock at all)."""

    def __init__(self, build: Callable[[Any], T]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]
        if self.name in obj.__dict__:  # normally not reached: the instance's value shadows us
            return obj.__dict__[self.name]
        with _LOAD_LOCK:
            if self.name not in obj.__dict__:
                obj.__dict__[self.name] = self.build(obj)
            return obj.__dict__[self.name]


@contextmanager
def _model_errors(what: str) -> Iterator[None]:
    """Any failure while loading becomes ModelUnavailable, except the ones that say the model
    itself is wrong (not found, unsupported: the job's error, with their own messages)."""
    from ingest.token_rules import ModelFilesUnavailable, UnsupportedModel

    try:
        yield
    except (ModelUnavailable, ModelFilesUnavailable, UnsupportedModel):
        raise
    except Exception as exc:
        raise ModelUnavailable(f"{what} could not be loaded: {describe(exc)}") from exc


def resolve_model_name(name: str) -> str:
    """A local folder is recorded by its absolute path, so results say which model made them."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


class Runtime:
    def __init__(
        self,
        settings: Settings,
        model: str | None = None,
        db: Database | None = None,
        *,
        existing_db: bool = False,
        on_migrated: Callable[[Database, Migrated], None] | None = None,
    ) -> None:
        """``existing_db``: the database must already be there, migrated (a command that reads or
        changes only what is stored: `cancel`, `purge`); else it is created and migrated on first
        use, and ``on_migrated`` is told when that happened (the command line says so)."""
        self.settings = settings
        self._existing_db = existing_db
        self._on_migrated = on_migrated
        self._owns_db = db is None
        if db is not None:  # shared by the runtimes of a worker process: not ours to close
            self.__dict__["db"] = db
        self._local = threading.local()
        self._lock = threading.Lock()
        self._splitters: list[IsolatedSplitter] = []
        self.model_name = resolve_model_name(model or settings.model)
        from storage.object_store import check_store_urls

        check_store_urls(settings)
        # Processes one splitting child spreads a PDF's pages over (ingest.spread).
        cores = os.cpu_count() or 1
        self.split_processes = settings.ingest_processes or max(1, cores // settings.ingest_workers)

    @cached_property
    def db(self) -> Database:
        url = self.settings.sqlalchemy_url()
        if self._existing_db:
            return open_existing(url)
        db = Database(url)
        migrated = db.ensure_schema()
        if migrated is not None and self._on_migrated is not None:
            self._on_migrated(db, migrated)
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

    @_LoadedOnce
    def adapter(self) -> ModelAdapter:
        """The model's adapter (its files read; the weights come with `load_model`)."""
        from worker.models import ModelRef, load_adapter

        ref = ModelRef(
            source=self.model_name,
            revision=self.settings.model_revision,
            device=self.settings.device,
            dtype=self.settings.dtype,
        )
        with _model_errors(f"model {self.model_name}"):
            adapter = load_adapter(ref)
            from worker.engines import choose_engine, needs_language_model

            # Resolved once, here, because it decides what of the model loads (the tower alone
            # when another engine generates); a family the engine cannot take fails now.
            engine = choose_engine(self.settings.engine, adapter, self.settings)
            adapter.vision_only = not needs_language_model(engine)
        self.__dict__["_engine_name"] = engine
        return adapter

    @property
    def engine_name(self) -> str:
        """vllm, transformers, openai or load: what `VISBATCH_ENGINE` means for this model here."""
        _ = self.adapter
        return self.__dict__["_engine_name"]

    def load_model(self) -> ModelAdapter:
        """The adapter with its processor and weights loaded: once per process, under the lock
        every task thread shares, before any of them uses it. ModelUnavailable when it fails
        (nothing is kept: a later call tries again)."""
        if self.__dict__.get("_model_loaded"):
            return self.adapter
        with _LOAD_LOCK:
            adapter = self.adapter
            if not self.__dict__.get("_model_loaded"):
                with _model_errors(f"model {self.model_name}"):
                    _ = adapter.config, adapter.tokenizer, getattr(adapter, "processor", None)
                    # Another engine generates: the tower alone; else the whole model (its tower too).
                    _ = adapter.vision_tower if adapter.vision_only else adapter.model
                self.__dict__["_model_loaded"] = True
        return adapter

    @_LoadedOnce
    def token_store(self) -> VisualTokenStore:
        from worker.tokens.store import VisualTokenStore

        if self.settings.cache_compression not in ("none", "zstd"):
            from visbatch.settings import SettingError

            raise SettingError(
                f"VISBATCH_CACHE_COMPRESSION={self.settings.cache_compression!r}: use none or zstd"
            )
        adapter = self.load_model()
        return VisualTokenStore(
            adapter,
            self.cache,
            self.store,
            self.settings.encode_batch_images,
            none_ttl_seconds=self.settings.cache_none_ttl_seconds,
            compress=self.settings.cache_compression == "zstd",
        )

    @_LoadedOnce
    def engine(self) -> Engine:
        from worker.engines import make_engine

        adapter = self.load_model()
        with _model_errors(f"engine {self.engine_name} for {self.model_name}"):
            return make_engine(self.engine_name, adapter, self.settings)

    @_LoadedOnce
    def requests(self) -> RequestBuilder:
        from worker.stages.generate.requests import RequestBuilder

        return RequestBuilder(
            self.load_model(), self.token_store, model_name=self.model_name, engine_name=self.engine.name
        )

    def warm_up(self) -> None:
        """Load what encode and generate need (weights, the engine) now: an embedded run does it
        beside ingest, so the first page finds the model ready instead of waiting for it."""
        self.load_model()
        engine = self.engine
        _ = self.requests, self.token_store
        with _LOAD_LOCK, _model_errors(f"engine {engine.name} for {self.model_name}"):
            engine.warm_up()  # an in-process vLLM builds its LLM now

    @property
    def generate_window(self) -> int:
        """Requests kept in flight in the engine (VISBATCH_GENERATE_WINDOW; default by engine)."""
        if self.settings.generate_window is not None:
            return self.settings.generate_window
        from worker.engines import default_window

        return default_window(self.engine_name, self.settings.max_batch_size)

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

    def images_encoded(self) -> int:
        """Images this runtime's token store sent through the vision tower; 0 when the store was
        never built (the model was never needed), without building it."""
        store = self.__dict__.get("token_store")
        return store.stats.images_encoded if store is not None else 0

    def close(self) -> None:
        self.close_splitters()
        if self._owns_db and "db" in self.__dict__:
            self.db.dispose()
