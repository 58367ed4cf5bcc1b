"""The S3 drop folder: objects dropped under ``s3://bucket/inbox/`` become jobs, each exactly once.

How an object goes through (``poll_once``):

1. The inbox prefix is listed (all pages; S3 listings are strongly consistent). Folder markers
   (keys ending in ``/``), spec files, error notes (``*.error.json``), watcher markers and
   anything under the done/failed prefixes are skipped.
2. Its spec is found (see "Spec files"); an object whose spec is missing or unusable is left
   alone, unclaimed, and picked up by a later poll once the spec is there or fixed.
3. It is claimed: one row per (bucket, key, etag) in ``drop_claims``, won by exactly one
   INSERT .. ON CONFLICT DO NOTHING RETURNING across all watchers and all time. Losers skip it.
4. With a done prefix, the claimed version is copied to ``<done>/<claim id>/<path under inbox>``
   first (``CopySourceIfMatch`` the claimed ETag, so exactly that content moves), and the job is
   submitted with THAT uri: ingest runs later, on another machine, and the inbox key is deleted
   right after the job exists. The claim id in the path keeps a later upload under the same name
   from overwriting what a queued job still has to read. A path that would not make a valid key
   (over S3's 1,024 bytes, control characters) is shortened: ``worker.drivers.dropfolder.keys.moved_key``.
   Without a done prefix the job gets the inbox uri and the object stays where it is.
   If the copy fails for a reason that may pass (S3 unreachable, throttled, 5xx; the object
   replaced or deleted meanwhile), the claim is given back and a later poll tries again: an
   outage never turns an object into a failure.
5. ``submit([uri], spec)`` creates the job; its id goes on the claim (``submitted``). Only then is
   the inbox object deleted (``IfMatch`` the claimed ETag: a newer upload under the same key is
   never deleted unprocessed) and the claim marked ``done``.
   If submit raises (or the copy fails for good), the claim is marked ``failed`` with the error,
   the done/ copy is removed and the object moved to ``<failed>/<claim id>/<path under inbox>``
   with ``<that key>.error.json`` beside it saying why (when a failed prefix is set; otherwise,
   or while it cannot be moved, the note sits beside the object in the inbox).

Exactly once: several watchers may poll the same prefix concurrently; the claim row decides.
Dropping the same bytes again (same ETag) never makes a second job, even when the spec file
changed meanwhile; the watcher says so at info level and moves the copy on (done/ or failed/).
Uploading new content under the same key gives a new ETag, hence a new claim and a new job. (An
ETag is what S3 reports for an upload: identical bytes uploaded in multipart with another part
size get another ETag and count as new.) To retry an object whose submit failed, drop it again
under another name. A watcher that crashes between claim and submit leaves the claim
``claimed``: it is not retried automatically (it cannot know whether the job was created) - at
most once rather than twice; such claims are visible by status and age.

Spec files (prompts, schema, sampling... as JSON, the fields of ``JobSpec``):

* ``<object name>.spec.json`` beside an object applies to that object only
  (``inbox/a.pdf.spec.json`` for ``inbox/a.pdf``);
* otherwise ``_spec.json`` in the object's folder, or else in the nearest folder above it up to
  the inbox root, applies to every object below that folder;
* otherwise ``default_spec``. A spec file's fields override the default spec's (top-level keys).

A spec file is checked exactly like ``visbatch submit`` checks its options (``JobSpec``, the JSON
schema compiled as for decoding). An unusable one gets ``<spec file>.error.json`` beside it with
the reason (and one warning in the log); its objects wait, unclaimed, until it is fixed, and the
note goes away then. Upload a folder's spec before its objects (or run without a default spec,
so that objects wait for theirs): an object is claimed with the spec in force when it is seen.

What a watcher refuses to touch (the object store, the token cache, another watcher's folders)
is ``worker.drivers.dropfolder.guard``'s business: the first poll checks, and refuses to start with one line.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ingest.spec import MAX_SPEC_BYTES, JobSpec, SpecError, spec_from_json
from storage.claims import release_claim
from storage.db import Database
from storage.errors import is_transient
from storage.models import ClaimStatus
from storage.object_store import S3ObjectStore, is_not_found, make_s3_client
from storage.repository import claim_object, find_claim, set_claim
from worker.drivers.dropfolder.guard import (
    MARKER_NAME,
    WatcherRefused,
    check_markers,
    marker_body,
    moved_folders,
    watch_layout,
)
from worker.drivers.dropfolder.keys import ERROR_SUFFIX, display_key, error_key, moved_key

log = logging.getLogger(__name__)

SPEC_SUFFIX = ".spec.json"
FOLDER_SPEC = "_spec.json"
_MAX_REMEMBERED = 10_000  # bounded memories of a long-running watcher
_LONG_WORD = re.compile(r"\S{97,}")

Submit = Callable[[list[str], JobSpec], str]


@dataclass(frozen=True, slots=True)
class DropObject:
    key: str
    etag: str  # as S3 lists it, quotes included
    size: int


@dataclass(slots=True)
class Listing:
    objects: list[DropObject] = field(default_factory=list)
    specs: dict[str, str] = field(default_factory=dict)  # spec key -> etag
    notes: dict[str, str] = field(default_factory=dict)  # error note key -> etag
    markers: list[str] = field(default_factory=list)  # watcher marker keys


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message``, bounded, with any long word (a URL or key the error
    quotes, such as botocore's "Could not connect to the endpoint URL: <url with the key>")
    shortened like a key."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = _LONG_WORD.sub(lambda m: display_key(m.group(), limit=80), text)
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _name(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _is_spec(key: str) -> bool:
    name = _name(key)
    return name == FOLDER_SPEC or name.endswith(SPEC_SUFFIX)


def protected_places(settings: Any) -> dict[str, str | None]:
    """``{what: url}`` of the settings' places a watcher must never move objects from."""
    return {
        "the object store (VISBATCH_STORE_URL)": settings.object_store_url(),
        "the token cache (VISBATCH_CACHE_URL)": settings.token_cache_url(),
        "the cold token cache (VISBATCH_CACHE_COLD_URL)": settings.cache_cold_url,
    }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class DropFolderWatcher:
    """Polls one S3 prefix and turns each new object version into one job (see the module doc)."""

    def __init__(
        self,
        s3: S3ObjectStore | Any,
        db: Database,
        prefix_url: str,
        submit: Submit,
        default_spec: JobSpec | None = None,
        *,
        done_prefix: str | None = "done/",
        failed_prefix: str | None = "failed/",
        poll_seconds: float = 5.0,
        protected: Mapping[str, str | None] | None = None,
    ) -> None:
        """``protected``: ``{what: url}`` of places the watcher must never move objects from (the
        object store, the token cache; ``from_settings`` fills it in). Raises WatcherRefused (a
        ValueError) when the inbox, done or failed prefix overlaps one of them."""
        # An S3ObjectStore lends its client; anything else is taken to be a boto3 S3 client.
        # Not the store's own methods: dropped objects have user names (spaces, accents) that
        # visbatch's content keys never have.
        self.client = s3.client if isinstance(s3, S3ObjectStore) else s3
        self.db = db
        layout = watch_layout(prefix_url, done_prefix, failed_prefix, protected or {})
        self.inbox, self.moved = layout.inbox, layout.moved
        self.bucket, self.prefix = layout.inbox.bucket, layout.inbox.prefix
        self.done_prefix = layout.done.prefix if layout.done else None
        self.failed_prefix = layout.failed.prefix if layout.failed else None
        self.submit = submit
        self.default_spec = default_spec
        self.poll_seconds = poll_seconds
        self._started = False
        # Problems are logged once per (key, etag, message), not once per poll.
        self._reported: set[tuple[str, str, str]] = set()
        # Parsed spec files by (key, etag): a spec version is read once, not once per poll.
        self._specs: dict[tuple[str, str], JobSpec | SpecError] = {}
        # Error notes by (key, etag): whether this watcher wrote it (only those are ever deleted).
        self._our_notes: dict[tuple[str, str], bool] = {}
        # Folders another watcher marked after this one started: left alone.
        self._foreign: set[str] = set()

    @classmethod
    def from_url(cls, prefix_url: str, db: Database, submit: Submit, **kwargs: Any) -> DropFolderWatcher:
        endpoint_url = kwargs.pop("endpoint_url", None)
        return cls(make_s3_client(endpoint_url), db, prefix_url, submit, **kwargs)

    @classmethod
    def from_settings(
        cls, settings: Any, prefix_url: str, db: Database, submit: Submit, **kwargs: Any
    ) -> DropFolderWatcher:
        """A watcher with the settings' S3 endpoint, guarding the settings' store and token cache."""
        kwargs.setdefault("endpoint_url", settings.s3_endpoint_url)
        return cls.from_url(prefix_url, db, submit, protected=protected_places(settings), **kwargs)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """poll_once every ``poll_seconds`` until ``stop_event`` is set; a failed poll is logged
        and retried at the next interval (S3 or the database may be briefly away). A refusal
        (WatcherRefused) ends the loop: it is raised to the caller, as is a first poll's failure
        that retrying cannot change (its cause chained)."""
        log.info("watching %s every %.1f s", self.inbox.url, self.poll_seconds)
        failing = False  # an outage is said when it starts and when it ends, not at every poll
        while not stop_event.is_set():
            try:
                self.poll_once()
            except WatcherRefused:
                raise
            except Exception as exc:
                transient = is_transient(exc)
                if not self._started and not transient:
                    # The first poll failed for a reason a retry cannot change (no credentials, no
                    # such bucket, access denied): a daemon that logged it every poll would look
                    # alive and never make a job.
                    raise WatcherRefused(f"cannot watch {self.inbox.url}: {_describe(exc)}") from exc
                if not transient:
                    log.exception("drop folder: poll of %s failed", self.inbox.url)
                elif not failing:
                    log.warning(
                        "drop folder: poll of %s failed (%s); retrying every %.1f s",
                        self.inbox.url,
                        _describe(exc),
                        self.poll_seconds,
                    )
                else:
                    log.debug("drop folder: poll failed again (%s)", _describe(exc))
                failing = True
            else:
                if failing:
                    log.info("drop folder: polls of %s work again", self.inbox.url)
                failing = False
            stop_event.wait(self.poll_seconds)

    def start(self) -> Listing:
        """The first poll's checks (see ``worker.drivers.dropfolder.guard``), then this watcher's markers.
        Raises WatcherRefused; returns the listing it made."""
        listing = self._list()
        check_markers(self.client, self.inbox, self.moved, listing.markers)
        found = moved_folders(self.db, self.bucket, (o.key for o in listing.objects))
        found.pop(self.prefix, None)  # objects moved back into the inbox on purpose are just objects
        if found:
            folder, example = next(iter(found.items()))
            raise WatcherRefused(
                f"refusing to watch {self.inbox.url}: it contains s3://{self.bucket}/{display_key(folder)}, "
                f"which holds objects a drop-folder watcher moved there (e.g. {display_key(example)}), "
                "read by their jobs; move the inbox, or pass that folder as --done-prefix/--failed-prefix"
            )
        for area in (self.inbox, *self.moved):
            role = area.name.split()[0]
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=area.prefix + MARKER_NAME,
                    Body=marker_body(role, self.inbox, self.moved),
                    ContentType="application/json",
                )
            except Exception as exc:  # protection for other watchers is weaker; this one works
                log.warning("drop folder: could not mark %s as this watcher's (%s)", area.url, _describe(exc))
        self._started = True
        log.info("drop folder: %s checked and marked", self.inbox.url)
        return listing

    def poll_once(self) -> list[str]:
        """One pass over the inbox; returns the ids of the jobs this call created."""
        listing = self.start() if not self._started else self._list()
        self._leave_foreign_folders(listing)
        notes: dict[str, dict[str, Any]] = {}  # error notes this pass wants: key -> body
        specs = self._resolve_specs(listing, notes)
        objects = list(listing.objects)
        # Concurrent watchers list the same keys: a different order per watcher spreads the work
        # instead of having them all queue on the same claim row.
        random.shuffle(objects)
        created = []
        for obj in objects:
            spec = self._spec_for(obj, listing, specs)
            if spec is None:
                continue
            try:
                job_id = self._process(obj, spec, notes)
            except Exception as exc:  # one object's trouble must not stop the rest of the pass
                if is_transient(exc):
                    log.warning("drop folder: %s not processed now (%s)", self._url(obj.key), _describe(exc))
                else:
                    log.exception("drop folder: %s could not be processed", self._url(obj.key))
                continue
            if job_id is not None:
                created.append(job_id)
        self._sync_notes(listing, notes)
        return created

    # -- listing and specs -------------------------------------------------------------------

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{display_key(key)}"

    def _excluded(self, key: str) -> bool:
        return any(p is not None and key.startswith(p) for p in (self.done_prefix, self.failed_prefix))

    def _list(self) -> Listing:
        listing = Listing()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                key = item["Key"]
                if key.endswith("/") or self._excluded(key):
                    continue  # folder marker, or already moved on
                name = _name(key)
                if name == MARKER_NAME:
                    if key != self.prefix + MARKER_NAME:
                        listing.markers.append(key)
                elif name.endswith(ERROR_SUFFIX):
                    listing.notes[key] = item["ETag"]
                elif _is_spec(key):
                    listing.specs[key] = item["ETag"]
                else:
                    listing.objects.append(DropObject(key, item["ETag"], int(item.get("Size", 0))))
        return listing

    def _leave_foreign_folders(self, listing: Listing) -> None:
        """A folder another watcher marked after this one started is that watcher's: its objects
        are left alone (start() refuses such a folder; this covers one created later)."""
        for key in listing.markers:
            folder = key[: -len(MARKER_NAME)]
            if folder not in self._foreign:
                self._foreign.add(folder)
                log.warning(
                    "drop folder: %s belongs to another drop-folder watcher (its marker appeared); "
                    "leaving it alone",
                    self._url(folder),
                )
        if self._foreign:
            inside = lambda key: any(key.startswith(f) for f in self._foreign)  # noqa: E731
            listing.objects = [o for o in listing.objects if not inside(o.key)]
            listing.specs = {k: v for k, v in listing.specs.items() if not inside(k)}
            listing.notes = {k: v for k, v in listing.notes.items() if not inside(k)}

    def _resolve_specs(self, listing: Listing, notes: dict[str, dict[str, Any]]) -> dict[str, JobSpec | None]:
        """Every listed spec file, parsed once per version: a JobSpec, or None (unusable: its
        note is wanted; or unreadable for now: it is read again next poll)."""
        if len(self._specs) > _MAX_REMEMBERED:
            self._specs.clear()
        resolved: dict[str, JobSpec | None] = {}
        for key, etag in listing.specs.items():
            outcome = self._specs.get((key, etag))
            if outcome is None:
                try:
                    outcome = self._read_spec(key, etag)
                except Exception as exc:  # gone, replaced, or S3 away: not the spec's fault
                    if not (is_not_found(exc) or _error_code(exc) == "PreconditionFailed"):
                        problem = f"spec file not readable now ({_describe(exc)}); its objects wait"
                        self._report(key, etag, problem)
                    resolved[key] = None
                    continue
                self._specs[(key, etag)] = outcome
            if isinstance(outcome, SpecError):
                self._report(key, etag, f"unusable spec file: {outcome}; its objects wait")
                notes[error_key(key, self.prefix)] = self._note(
                    key,
                    etag,
                    str(outcome),
                    "Fix this spec file (upload a corrected one): the objects it applies to wait in the "
                    "inbox, unclaimed, and go through once it is usable. This note then goes away.",
                )
                resolved[key] = None
            else:
                resolved[key] = outcome
        return resolved

    def _read_spec(self, spec_key: str, etag: str) -> JobSpec | SpecError:
        response = self.client.get_object(Bucket=self.bucket, Key=spec_key, IfMatch=etag)
        with response["Body"] as body:
            raw = body.read(MAX_SPEC_BYTES + 1)
        try:
            return spec_from_json(raw, self.default_spec, what="the spec file")
        except SpecError as exc:
            return exc

    def _spec_key_for(self, key: str, specs: dict[str, str]) -> str | None:
        if key + SPEC_SUFFIX in specs:
            return key + SPEC_SUFFIX
        folders = key[len(self.prefix) :].split("/")[:-1]
        for depth in range(len(folders), -1, -1):  # nearest folder first, the inbox root last
            candidate = self.prefix + "".join(f"{name}/" for name in folders[:depth]) + FOLDER_SPEC
            if candidate in specs:
                return candidate
        return None

    def _spec_for(
        self, obj: DropObject, listing: Listing, specs: dict[str, JobSpec | None]
    ) -> JobSpec | None:
        spec_key = self._spec_key_for(obj.key, listing.specs)
        if spec_key is None:
            if self.default_spec is None:
                self._report(obj.key, obj.etag, "no spec file and no default spec: waiting for one")
            return self.default_spec
        return specs.get(spec_key)

    def _report(self, key: str, etag: str, message: str, level: int = logging.WARNING) -> None:
        if (key, etag, message) not in self._reported:
            if len(self._reported) >= _MAX_REMEMBERED:  # a long-running watcher must not grow without bound
                self._reported.clear()
            self._reported.add((key, etag, message))
            log.log(level, "drop folder: %s: %s", self._url(key), message)

    # -- error notes -------------------------------------------------------------------------

    def _note(self, key: str, etag: str, error: str, what_to_do: str, claim_id: int | None = None) -> dict:
        return {
            "visbatch": "drop-folder error",
            "subject": key,
            "etag": etag.strip('"'),
            "claim": claim_id,
            "error": error,
            "what_to_do": what_to_do,
            "written_at": _now(),
        }

    def _put_note(self, key: str, body: dict[str, Any]) -> None:
        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=json.dumps(body, indent=2).encode(),
                ContentType="application/json",
            )
        except Exception as exc:
            log.warning("drop folder: could not write the note %s (%s)", self._url(key), _describe(exc))

    def _is_our_note(self, key: str, etag: str) -> bool:
        if (key, etag) not in self._our_notes:
            if len(self._our_notes) >= _MAX_REMEMBERED:
                self._our_notes.clear()
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=etag)
                with response["Body"] as body:
                    data = json.loads(body.read(MAX_SPEC_BYTES))
                ours = isinstance(data, dict) and data.get("visbatch") == "drop-folder error"
            except ValueError:
                ours = False  # not JSON: a file of the user's, never deleted
            except Exception:
                return False  # gone, changed, or unreadable now: decided on a later poll
            self._our_notes[(key, etag)] = ours
        return self._our_notes[(key, etag)]

    def _sync_notes(self, listing: Listing, wanted: dict[str, dict[str, Any]]) -> None:
        """Write the notes this pass wants and delete this watcher's notes it no longer wants (the
        spec was fixed, the object moved on). Notes already there are left as they are."""
        for key, body in wanted.items():
            if key not in listing.notes:
                self._put_note(key, body)
        for key, etag in listing.notes.items():
            if key not in wanted and self._is_our_note(key, etag):
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
                except Exception as exc:
                    if not (is_not_found(exc) or _error_code(exc) == "PreconditionFailed"):
                        log.warning("drop folder: could not delete %s (%s)", self._url(key), _describe(exc))

    # -- one object --------------------------------------------------------------------------

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) :]

    def _process(self, obj: DropObject, spec: JobSpec, notes: dict[str, dict[str, Any]]) -> str | None:
        etag = obj.etag.strip('"')
        claim_id = claim_object(self.db, self.bucket, obj.key, etag)
        if claim_id is None:
            self._settle_earlier_claim(obj, etag, notes)
            return None

        uri_key = obj.key
        if self.done_prefix is not None:
            uri_key = moved_key(self.done_prefix, claim_id, self._relative(obj.key))
            try:
                self._copy(obj, uri_key)
            except Exception as exc:
                if is_transient(exc) or is_not_found(exc) or _error_code(exc) == "PreconditionFailed":
                    self._give_back(claim_id, obj, uri_key, exc)
                else:
                    error = f"could not copy it to {self._url(uri_key)}: {_describe(exc)}"
                    self._fail(claim_id, obj, error, notes)
                return None
        try:
            job_id = self.submit([f"s3://{self.bucket}/{uri_key}"], spec)
        except Exception as exc:
            self._fail(claim_id, obj, f"submit failed: {_describe(exc)}", notes)
            if uri_key != obj.key:
                self._discard(uri_key)  # no job will ever read this copy
            return None
        set_claim(self.db, claim_id, status=ClaimStatus.SUBMITTED, job_id=job_id)
        if self.done_prefix is not None:
            self._delete_version(obj)
        set_claim(self.db, claim_id, status=ClaimStatus.DONE)
        log.info("drop folder: %s -> job %s", self._url(obj.key), job_id)
        return job_id

    def _give_back(self, claim_id: int, obj: DropObject, target: str, exc: BaseException) -> None:
        """The copy did not happen for a reason that may pass (S3 away) or that makes this version
        moot (replaced or deleted meanwhile): no job exists, so the claim is released and a later
        poll claims whatever is there then."""
        if is_transient(exc):
            log.warning(
                "drop folder: %s not moved now (%s); it stays in the inbox and is tried again",
                self._url(obj.key),
                _describe(exc),
            )
            self._discard(target)  # in case the copy landed and only its answer was lost
        else:
            log.info("drop folder: %s changed or went away while being claimed; skipped", self._url(obj.key))
        release_claim(self.db, claim_id)

    def _fail(self, claim_id: int, obj: DropObject, error: str, notes: dict[str, dict[str, Any]]) -> None:
        log.warning("drop folder: %s: %s", self._url(obj.key), error)
        set_claim(self.db, claim_id, status=ClaimStatus.FAILED, error=error)
        self._move_to_failed(claim_id, obj, error, notes)

    def _failed_note(self, obj: DropObject, claim_id: int, error: str) -> dict[str, Any]:
        return self._note(
            obj.key,
            obj.etag,
            error,
            "No job was made for this object. To try again, drop it again under another name "
            "(the same name with the same content is recognised and not retried).",
            claim_id,
        )

    def _move_to_failed(
        self, claim_id: int, obj: DropObject, error: str | None, notes: dict[str, dict[str, Any]]
    ) -> bool:
        """Move a failed object to failed/ with its note beside it; while it cannot be moved (or
        without a failed prefix) the note sits beside it in the inbox. True if it moved."""
        note = self._failed_note(obj, claim_id, error or "failed")
        if self.failed_prefix is None:
            notes[error_key(obj.key, self.prefix)] = note
            return False
        target = moved_key(self.failed_prefix, claim_id, self._relative(obj.key))
        try:
            self._copy(obj, target)
        except Exception as exc:
            if is_not_found(exc) or _error_code(exc) == "PreconditionFailed":
                return False  # moved by another watcher meanwhile, or replaced: nothing left to move
            self._report(
                obj.key,
                obj.etag,
                f"could not be moved to failed/ ({_describe(exc)}); it stays in the inbox with "
                f"{display_key(_name(error_key(obj.key, self.prefix)))} beside it, and is tried again",
            )
            notes[error_key(obj.key, self.prefix)] = note
            return False
        self._put_note(error_key(target, self.failed_prefix), note)
        self._delete_version(obj)
        return True

    def _settle_earlier_claim(self, obj: DropObject, etag: str, notes: dict[str, dict[str, Any]]) -> None:
        """This version was claimed before: finish a move that was cut short, or move on a re-drop of
        content already handled, and say so. A claim still ``claimed`` belongs to a watcher at work
        (or one that crashed): left alone."""
        claim = find_claim(self.db, self.bucket, obj.key, etag)
        if claim is None:
            return  # given back meanwhile: the next poll claims it
        if claim.status == ClaimStatus.CLAIMED:
            self._report(
                obj.key,
                obj.etag,
                f"claimed (claim {claim.id}) by a watcher at work, or by one that stopped before "
                "making a job; left alone",
                logging.INFO,
            )
            return
        if claim.status == ClaimStatus.FAILED:
            if self._move_to_failed(claim.id, obj, claim.error, notes):
                log.info(
                    "drop folder: %s: the same content as claim %d, which failed (%s); moved to failed/ "
                    "again, no new job (to try again, drop it under another name)",
                    self._url(obj.key),
                    claim.id,
                    claim.error,
                )
            return
        if self.done_prefix is None:
            return  # objects stay in the inbox: seeing it again is the normal case
        # submitted or done: the done/ copy was made before the job was; only the delete is left.
        if not self._delete_version(obj):
            return  # another watcher finished this move
        if claim.status != ClaimStatus.DONE:
            set_claim(self.db, claim.id, status=ClaimStatus.DONE)
            log.info("drop folder: %s -> job %s (move finished)", self._url(obj.key), claim.job_id)
            return
        log.info(
            "drop folder: %s: the same content as claim %d, which went to job %s; removed from the "
            "inbox, no new job: identical bytes make one job, even if the spec changed (to run it "
            "again, drop it under another name or use visbatch submit)",
            self._url(obj.key),
            claim.id,
            claim.job_id,
        )

    # -- S3 moves ----------------------------------------------------------------------------

    def _copy(self, obj: DropObject, target: str) -> None:
        # Managed copy: multipart above the threshold, so objects over 5 GB move too.
        # CopySourceIfMatch: exactly the claimed version, never newer content under the same key.
        self.client.copy(
            {"Bucket": self.bucket, "Key": obj.key},
            self.bucket,
            target,
            ExtraArgs={"CopySourceIfMatch": obj.etag},
        )

    def _discard(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # an orphan copy is untidy, not wrong
            log.warning("drop folder: could not delete %s (%s)", self._url(key), _describe(exc))

    def _delete_version(self, obj: DropObject) -> bool:
        """Delete the inbox key if it still holds the claimed version; True if this call deleted it."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=obj.key, IfMatch=obj.etag)
        except Exception as exc:
            code = _error_code(exc)
            if is_not_found(exc):
                return False  # another watcher finished the move
            if code == "PreconditionFailed":
                return False  # new content under this key: it gets its own claim
            if code == "NotImplemented":  # a store without conditional deletes
                self.client.delete_object(Bucket=self.bucket, Key=obj.key)
                return True
            raise
        return True
