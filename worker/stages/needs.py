"""What each stage uses of the services a driver built, one protocol per stage.

A stage is handed these, not a Runtime: a reader sees in one place every service a stage can
touch, a test can hand a stage a small object with only those, and the stage layer never
imports worker.runtime (which builds them, and knows the settings, models and engines).
`worker.runtime.Runtime` provides every one of them; tests/test_layers.py checks that no stage
imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ingest.isolation import IsolatedSplitter
    from ingest.limits import Limits
    from ingest.token_rules import TokenRule
    from storage.db import Database
    from storage.object_store import ObjectStore
    from visbatch.settings import Settings
    from worker.engines import Engine
    from worker.retry import RetryPolicy
    from worker.stages.generate.requests import RequestBuilder
    from worker.tokens.store import VisualTokenStore


class StartNeeds(Protocol):
    """Starting or reopening a job: the database, and the model the job's results name."""

    @property
    def db(self) -> Database: ...

    @property
    def model_name(self) -> str: ...


class IngestNeeds(Protocol):
    """Splitting a source: where it is read from, the splitting child, the limits and the model's
    token rule (its JSON files, no weights), and the database its rows go to."""

    @property
    def db(self) -> Database: ...

    @property
    def store(self) -> ObjectStore: ...

    @property
    def settings(self) -> Settings: ...  # the S3 endpoint a user's s3:// source is read from

    @property
    def limits(self) -> Limits: ...

    @property
    def token_rule(self) -> TokenRule: ...

    def splitter(self) -> IsolatedSplitter: ...


class EncodeNeeds(Protocol):
    """Encoding units: the token store (the tower and the cache) and the database."""

    @property
    def db(self) -> Database: ...

    @property
    def token_store(self) -> VisualTokenStore: ...


class GenerateNeeds(Protocol):
    """Answering units: the engine and the requests built for it, how many requests it keeps in
    flight, the retry policy for the database, and the token store (to drop what policy `none`
    cached once the answers are stored)."""

    @property
    def db(self) -> Database: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def requests(self) -> RequestBuilder: ...

    @property
    def generate_window(self) -> int: ...

    @property
    def retry(self) -> RetryPolicy: ...

    @property
    def token_store(self) -> VisualTokenStore: ...
