"""Database models: jobs, their sources, the units (pages, frames) cut from them, and results.

One schema for SQLite (embedded) and PostgreSQL (fleet); ``migrations/`` creates exactly this
(``tests/test_migrations.py`` checks that no drift creeps in). Only ``storage.repository``
reads and writes these tables for the pipeline.
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
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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


# JSONB on PostgreSQL so outputs can be queried and indexed; none_as_null so a Python None is
# SQL NULL ("no output") rather than the JSON literal null.
JSONDocument = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")

# 64-bit keys on PostgreSQL (a fleet can write billions of results); SQLite only autoincrements
# a column declared exactly INTEGER PRIMARY KEY, which is 64-bit there anyway.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")

STATUS_LENGTH = 16
# Objects declared with ``info={ONLY_ON: "postgresql"}`` exist on that dialect only (see
# ``include_object_for``): the database does not have them elsewhere, by design.
ONLY_ON = "only_on_dialect"
KEY_LENGTH = 1024  # S3 object keys are at most 1024 bytes


class Base(DeclarativeBase):
    # Named constraints make migrations (and SQLite batch rebuilds) deterministic.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


def _counter() -> Mapped[int]:
    return mapped_column(Integer, nullable=False, default=0, server_default="0")


def _seconds() -> Mapped[float]:
    return mapped_column(Float, nullable=False, default=0.0, server_default="0")


def _token_counter() -> Mapped[int]:
    # Token sums of a big job pass 2**31.
    return mapped_column(BigInteger, nullable=False, default=0, server_default="0")


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_job_id)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    status: Mapped[str] = mapped_column(
        String(STATUS_LENGTH), nullable=False, default=JobStatus.QUEUED.value, index=True
    )
    spec: Mapped[dict[str, Any]] = mapped_column(JSONDocument, nullable=False)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)

    sources_total: Mapped[int] = _counter()
    sources_failed: Mapped[int] = _counter()
    units_total: Mapped[int] = _counter()
    units_failed: Mapped[int] = _counter()
    # Units neither done nor failed: the fan-in countdown (see repository.finish_units).
    units_pending: Mapped[int] = _counter()
    results_total: Mapped[int] = _counter()
    results_failed: Mapped[int] = _counter()
    cache_hits: Mapped[int] = _counter()
    cache_misses: Mapped[int] = _counter()
    visual_tokens: Mapped[int] = _token_counter()
    prompt_tokens: Mapped[int] = _token_counter()
    completion_tokens: Mapped[int] = _token_counter()
    # Streaming (migration 0004): when work began and the first result landed, and each stage's
    # busy time summed over every process that worked on the job (wall time is finished - started).
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    first_result_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ingest_seconds: Mapped[float] = _seconds()
    encode_seconds: Mapped[float] = _seconds()
    generate_seconds: Mapped[float] = _seconds()


class Source(Base):
    __tablename__ = "sources"
    __table_args__ = (UniqueConstraint("job_id", "uri"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)
    uri: Mapped[str] = mapped_column(Text, nullable=False)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kind: Mapped[str | None] = mapped_column(String(STATUS_LENGTH), nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    status: Mapped[str] = mapped_column(
        String(STATUS_LENGTH), nullable=False, default=SourceStatus.PENDING.value
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    # Units before this index are stored (migration 0004): the cursor of range-by-range ingest.
    next_unit: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")


class Unit(Base):
    __tablename__ = "units"
    __table_args__ = (
        # "index" is an SQL keyword: the column is named unit_index, the attribute stays ``index``.
        UniqueConstraint("source_id", "unit_index"),
        # Serves "this job's units in state X" (resume, counts) and plain per-job lookups.
        Index("ix_units_job_id_status", "job_id", "status"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    source_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("sources.id", ondelete="CASCADE"), nullable=False
    )
    job_id: Mapped[str] = mapped_column(String(32), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)
    index: Mapped[int] = mapped_column("unit_index", Integer, nullable=False)
    timestamp: Mapped[float | None] = mapped_column(Float, nullable=True)
    width: Mapped[int | None] = mapped_column(Integer, nullable=True)
    height: Mapped[int | None] = mapped_column(Integer, nullable=True)
    image_key: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    visual_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cache_key: Mapped[str | None] = mapped_column(String(KEY_LENGTH), nullable=True)
    cache_hit: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    status: Mapped[str] = mapped_column(
        String(STATUS_LENGTH), nullable=False, default=UnitStatus.PENDING.value
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The visual-token budget (migration 0003): the resize bounds this unit is encoded with (NULL:
    # the model's own), its tokens at the model's own bounds (for "tokens saved"), and for a
    # skipped frame why, and which kept frame it repeats.
    min_pixels: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_pixels: Mapped[int | None] = mapped_column(Integer, nullable=True)
    full_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    skip_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    duplicate_of: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Result(Base):
    __tablename__ = "results"
    __table_args__ = (
        UniqueConstraint("unit_id", "prompt_index"),
        # PostgreSQL only: lets containment and JSON-path equality queries on outputs use an index,
        # e.g. ``output @> '{"vendor": "ACME"}'`` or ``output @@ '$.vendor == "ACME"'`` (also through
        # the result_rows view). jsonb_path_ops: smaller and faster than the default opclass, and
        # those are the operators it serves. SQLite has neither JSONB nor GIN.
        Index(
            "ix_results_output_gin",
            "output",
            postgresql_using="gin",
            postgresql_ops={"output": "jsonb_path_ops"},
            info={ONLY_ON: "postgresql"},
        ).ddl_if(dialect="postgresql"),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    unit_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("units.id", ondelete="CASCADE"), nullable=False
    )
    job_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False, index=True
    )
    prompt_index: Mapped[int] = mapped_column(Integer, nullable=False)
    output: Mapped[Any | None] = mapped_column(JSONDocument, nullable=True)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    visual_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    # Visual tokens left out of the LM input by pruning (visual_tokens counts the whole image).
    pruned_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # Visual tokens merged into neighbours before the LM (migration 0004).
    merged_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    engine: Mapped[str] = mapped_column(String(64), nullable=False)
    cache_hit: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    latency_ms: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow)


class DropClaim(Base):
    """One object seen in an S3 drop folder, claimed by exactly one watcher.

    Unique on (bucket, key, etag): the INSERT that wins the row is the claim, so several
    watchers and re-drops of identical content make one job; new content (a new ETag) under the
    same key is a new claim and a new job.
    """

    __tablename__ = "drop_claims"
    __table_args__ = (UniqueConstraint("bucket", "key", "etag"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    bucket: Mapped[str] = mapped_column(String(63), nullable=False)  # S3 bucket names: 3..63
    key: Mapped[str] = mapped_column(String(KEY_LENGTH), nullable=False)
    etag: Mapped[str] = mapped_column(String(255), nullable=False)
    # The job stays traceable from the claim; deleting old jobs must not be blocked by claims.
    job_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True, index=True
    )
    status: Mapped[str] = mapped_column(
        String(STATUS_LENGTH), nullable=False, default=ClaimStatus.CLAIMED.value
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow, onupdate=utcnow)


def include_object_for(dialect_name: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """An Alembic ``include_object`` hook that leaves out model objects meant for another dialect.

    Alembic's comparison does not honour SQLAlchemy's ``ddl_if``; without this a SQLite database
    would always "lack" the PostgreSQL-only GIN index. Reflected objects are always compared.
    """

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        only_on = getattr(obj, "info", {}).get(ONLY_ON) if not reflected else None
        return only_on is None or only_on == dialect_name

    return include_object
