"""Database models: jobs, their sources, the units (pages, frames) cut from them, and results.

One schema for SQLite (embedded) and PostgreSQL (fleet); ``migrations/`` creates exactly this
(``tests/test_migrations.py`` checks that no drift creeps in). Only ``storage.repository``
reads and writes these tables for the pipeline.

Plain SQLAlchemy Core tables, no ORM classes: every query is a Core statement, and a command
that only reads (`visbatch status`) does not pay for importing the ORM.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.types import TypeEngine


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_JOB_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.PARTIAL, JobStatus.FAILED, JobStatus.CANCELLED}
)


class SourceStatus(StrEnum):
    PENDING = "pending"
    INGESTED = "ingested"
    FAILED = "failed"


class SourceKind(StrEnum):
    PDF = "pdf"
    VIDEO = "video"
    IMAGE = "image"


class UnitStatus(StrEnum):
    PENDING = "pending"
    ENCODED = "encoded"
    DONE = "done"
    FAILED = "failed"
    # A video frame left out as a near-duplicate of an earlier kept frame (skip_reason says why):
    # never encoded nor asked, and not a failure.
    SKIPPED = "skipped"


class ClaimStatus(StrEnum):
    """A drop-folder object's way: claimed -> submitted (job created) -> done (moved), or failed."""

    CLAIMED = "claimed"
    SUBMITTED = "submitted"
    DONE = "done"
    FAILED = "failed"


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_job_id() -> str:
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that always comes back timezone-aware in UTC.

    SQLite has no timezone type and would hand back naive datetimes while PostgreSQL hands back
    aware ones; normalising here keeps ``isoformat()`` output identical in both shapes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        # SQLite's DATETIME storage drops tzinfo silently; store plain UTC so ordering is right.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class JSONDocument(TypeDecorator[Any]):
    """JSON, stored as JSONB on PostgreSQL so outputs can be queried and indexed.

    A Python None is SQL NULL ("no output"), never the JSON literal null. The PostgreSQL type is
    chosen when a dialect asks for it: importing that dialect (asyncio and more) up front would
    slow every `visbatch status` on SQLite.
    """

    impl = JSON(none_as_null=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import JSONB

            return dialect.type_descriptor(JSONB(none_as_null=True))
        return super().load_dialect_impl(dialect)  # impl: JSON(none_as_null=True)


# 64-bit keys on PostgreSQL (a fleet can write billions of results); SQLite only autoincrements
# a column declared exactly INTEGER PRIMARY KEY, which is 64-bit there anyway.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")

STATUS_LENGTH = 16
# Objects declared with ``info={ONLY_ON: "postgresql"}`` exist on that dialect only (see
# ``include_object_for``): the database does not have them elsewhere, by design.
ONLY_ON = "only_on_dialect"
KEY_LENGTH = 1024  # S3 object keys are at most 1024 bytes


# Named constraints make migrations (and SQLite batch rebuilds) deterministic.
METADATA = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _status(default: StrEnum, **extra: Any) -> Column[str]:
    return Column("status", String(STATUS_LENGTH), nullable=False, default=default.value, **extra)


def _counter(name: str) -> Column[int]:
    return Column(name, Integer, nullable=False, default=0, server_default="0")


def _seconds(name: str) -> Column[float]:
    return Column(name, Float, nullable=False, default=0.0, server_default="0")


def _token_counter(name: str) -> Column[int]:
    # Token sums of a big job pass 2**31.
    return Column(name, BigInteger, nullable=False, default=0, server_default="0")


def _created_at(**extra: Any) -> Column[datetime]:
    return Column("created_at", UTCDateTime, nullable=False, default=utcnow, **extra)


def _updated_at() -> Column[datetime]:
    return Column("updated_at", UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow)


def _job_ref(**extra: Any) -> Column[str]:
    return Column("job_id", String(32), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, **extra)


JOBS = Table(
    "jobs",
    METADATA,
    Column("id", String(32), primary_key=True, default=new_job_id),
    _created_at(index=True),
    _updated_at(),
    Column("finished_at", UTCDateTime, nullable=True),
    _status(JobStatus.QUEUED, index=True),
    Column("spec", JSONDocument, nullable=False),
    Column("error", Text, nullable=True),
    *map(_counter, ("sources_total", "sources_failed", "units_total", "units_failed")),
    # Units neither done nor failed: the fan-in countdown (see storage.sql).
    _counter("units_pending"),
    *map(_counter, ("results_total", "results_failed", "cache_hits", "cache_misses")),
    *map(_token_counter, ("visual_tokens", "prompt_tokens", "completion_tokens")),
    # Streaming (migration 0004): when work began and the first result landed, and each stage's
    # busy time summed over every process that worked on the job (wall time is finished - started).
    Column("started_at", UTCDateTime, nullable=True),
    Column("first_result_at", UTCDateTime, nullable=True),
    *map(_seconds, ("ingest_seconds", "encode_seconds", "generate_seconds")),
    # When the job was last resumed (migration 0005): by the fleet on its own, for want of progress
    # (worker.drivers.fleet.stall_watch: not again within the stall threshold), or by `visbatch resume`
    # (storage.jobs.reopen_job): a running job's rate counts from here, not its hours stopped.
    Column("resumed_at", UTCDateTime, nullable=True),
    # The process that runs (or last ran) the job in one process (migration 0006): "HOST:PID:START",
    # START being the process's start time (so that a reused pid is not taken for it; empty where
    # it cannot be read). `status` and `jobs` say `interrupted` when that process is gone
    # (worker.drivers.job_activity); kept as history when the run ends. NULL for a fleet job.
    Column("process", Text, nullable=True),
    # The run that holds the job now (migration 0008, storage.leases): a random token and when it
    # last renewed its lease. A run whose lease has expired is gone, wherever it ran; NULL once
    # the run let go (it ended) and for a fleet job.
    Column("lease_holder", String(32), nullable=True),
    Column("lease_renewed_at", UTCDateTime, nullable=True),
    Column("lease_expires_at", UTCDateTime, nullable=True),
    # What the job's work waits for (migration 0009, worker.stages.runner): the cause of its last
    # retry (a full disk, S3 away) and when it was noted; `status` shows it while it is recent.
    Column("waiting", Text, nullable=True),
    Column("waiting_at", UTCDateTime, nullable=True),
    # The job's token report (storage.token_report) as close_job counted it when the job finished
    # (migration 0007); NULL while it runs or once reopened. `status` reads it instead of summing
    # the job's results again: 10 million of them take seconds to sum, this one row none.
    Column("tokens", JSONDocument, nullable=True),
)

SOURCES = Table(
    "sources",
    METADATA,
    Column("id", BigIntId, primary_key=True, autoincrement=True),
    _job_ref(),
    Column("uri", Text, nullable=False),
    Column("sha256", String(64), nullable=True),
    Column("kind", String(STATUS_LENGTH), nullable=True),
    Column("bytes", BigInteger, nullable=True),
    _status(SourceStatus.PENDING),
    Column("error", Text, nullable=True),
    _created_at(),
    # Units before this index are stored (migration 0004): the cursor of range-by-range ingest.
    Column("next_unit", Integer, nullable=False, default=0, server_default="0"),
    # Where a fleet worker reads it (store:<key>, s3://...; migration 0005), recorded at submit so
    # that any worker can send its ingest again; NULL for a job run in one process.
    Column("location", Text, nullable=True),
    UniqueConstraint("job_id", "uri"),
)

UNITS = Table(
    "units",
    METADATA,
    Column("id", BigIntId, primary_key=True, autoincrement=True),
    Column("source_id", BigInteger, ForeignKey("sources.id", ondelete="CASCADE"), nullable=False),
    _job_ref(),
    # "index" is an SQL keyword: the page number (from 0) or frame number is unit_index.
    Column("unit_index", Integer, nullable=False),
    Column("timestamp", Float, nullable=True),
    Column("width", Integer, nullable=True),
    Column("height", Integer, nullable=True),
    Column("image_key", String(KEY_LENGTH), nullable=True),
    Column("text", Text, nullable=True),
    Column("visual_tokens", Integer, nullable=True),
    Column("cache_key", String(KEY_LENGTH), nullable=True),
    Column("cache_hit", Boolean, nullable=True),
    _status(UnitStatus.PENDING),
    Column("error", Text, nullable=True),
    # The visual-token budget (migration 0003): the resize bounds this unit is encoded with (NULL:
    # the model's own), its tokens at the model's own bounds (for "tokens saved"), and for a
    # skipped frame why, and which kept frame it repeats.
    Column("min_pixels", Integer, nullable=True),
    Column("max_pixels", Integer, nullable=True),
    Column("full_tokens", Integer, nullable=True),
    Column("skip_reason", Text, nullable=True),
    Column("duplicate_of", Integer, nullable=True),
    UniqueConstraint("source_id", "unit_index"),
    # Serves "this job's units in state X" (resume, counts) and plain per-job lookups.
    Index("ix_units_job_id_status", "job_id", "status"),
    # Which units (of which jobs) use a cached entry: `visbatch purge` keeps those (migration 0007).
    Index("ix_units_cache_key", "cache_key"),
)

RESULTS = Table(
    "results",
    METADATA,
    Column("id", BigIntId, primary_key=True, autoincrement=True),
    Column("unit_id", BigInteger, ForeignKey("units.id", ondelete="CASCADE"), nullable=False),
    _job_ref(index=True),
    Column("prompt_index", Integer, nullable=False),
    Column("output", JSONDocument, nullable=True),
    Column("text", Text, nullable=True),
    Column("error", Text, nullable=True),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("visual_tokens", Integer, nullable=False, default=0),
    Column("completion_tokens", Integer, nullable=False, default=0),
    # Visual tokens left out of the LM input by pruning (visual_tokens counts the whole image).
    Column("pruned_tokens", Integer, nullable=False, default=0, server_default="0"),
    # Visual tokens merged into neighbours before the LM (migration 0004).
    Column("merged_tokens", Integer, nullable=False, default=0, server_default="0"),
    Column("finish_reason", String(32), nullable=True),
    Column("model", String(255), nullable=False),
    Column("engine", String(64), nullable=False),
    Column("cache_hit", Boolean, nullable=False, default=False),
    Column("latency_ms", Float, nullable=False, default=0.0),
    _created_at(),
    _updated_at(),
    # What the answer covers (migration 0010, ingest.windows): `unit` (one page, frame or image),
    # `window` (the units unit_id .. unit_to of one source, in one prompt: keyed by its first
    # unit, and windows of a source start at different units) or `source` (its summary, keyed
    # by its first unit, prompt_index one past the job's prompts); turn 0 is the prompt itself.
    Column("scope", String(STATUS_LENGTH), nullable=False, default="unit", server_default="unit"),
    Column("unit_to", Integer, nullable=True),
    Column("turn", Integer, nullable=False, default=0, server_default="0"),
    UniqueConstraint("unit_id", "prompt_index", "turn"),
    # The PostgreSQL-only GIN index on output and the partial index of failed answers: see
    # schema_metadata().
)


# One object seen in an S3 drop folder, claimed by exactly one watcher. Unique on (bucket, key,
# etag): the INSERT that wins the row is the claim, so several watchers and re-drops of identical
# content make one job; new content (a new ETag) under the same key is a new claim and a new job.
DROP_CLAIMS = Table(
    "drop_claims",
    METADATA,
    Column("id", BigIntId, primary_key=True, autoincrement=True),
    Column("bucket", String(63), nullable=False),  # S3 bucket names: 3..63
    Column("key", String(KEY_LENGTH), nullable=False),
    Column("etag", String(255), nullable=False),
    # The job stays traceable from the claim; deleting old jobs must not be blocked by claims.
    Column("job_id", String(32), ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True, index=True),
    _status(ClaimStatus.CLAIMED),
    Column("error", Text, nullable=True),
    _created_at(),
    _updated_at(),
    UniqueConstraint("bucket", "key", "etag"),
)


def schema_metadata() -> MetaData:
    """The whole schema, for migrations and the drift test: the tables plus what exists on one
    dialect only, added on first call.

    That is the GIN index on ``results.output`` (PostgreSQL): it lets containment and JSON-path
    equality queries on outputs use an index, e.g. ``output @> '{"vendor": "ACME"}'`` or
    ``output @@ '$.vendor == "ACME"'`` (also through the result_rows view); jsonb_path_ops is
    smaller and faster than the default opclass, and those are the operators it serves. SQLite
    has neither JSONB nor GIN. It is declared here rather than beside the table because its
    ``postgresql_*`` options load the PostgreSQL dialect (asyncio and more), which every
    `visbatch status` on SQLite would pay for; the pipeline never creates tables from these
    objects (migrations do), so nothing else needs it.
    """
    if _GIN_INDEX not in {index.name for index in RESULTS.indexes}:
        Index(
            _GIN_INDEX,
            RESULTS.c.output,
            postgresql_using="gin",
            postgresql_ops={"output": "jsonb_path_ops"},
            info={ONLY_ON: "postgresql"},
        ).ddl_if(dialect="postgresql")
    if _FAILED_INDEX not in {index.name for index in RESULTS.indexes}:
        # A job's failed answers without reading its good ones (status's errors, the view's
        # "failed" filter, docs/sql.md's failed answers): a partial index, holding only the
        # failed rows (migration 0007). Declared here for the same reason as the GIN index: the
        # postgresql_where option loads the PostgreSQL dialect.
        failed = text("error IS NOT NULL")
        Index(_FAILED_INDEX, RESULTS.c.job_id, postgresql_where=failed, sqlite_where=failed)
    return METADATA


_GIN_INDEX = "ix_results_output_gin"
_FAILED_INDEX = "ix_results_job_id_failed"


def include_object_for(dialect_name: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """An Alembic ``include_object`` hook that leaves out model objects meant for another dialect.

    Alembic's comparison does not honour SQLAlchemy's ``ddl_if``; without this a SQLite database
    would always "lack" the PostgreSQL-only GIN index. Reflected objects are always compared.
    """

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        only_on = getattr(obj, "info", {}).get(ONLY_ON) if not reflected else None
        return only_on is None or only_on == dialect_name

    return include_object
