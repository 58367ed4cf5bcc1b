"""The S3 drop folder: objects dropped under ``s3://bucket/inbox/`` become jobs, each exactly once.

How an object goes through (``poll_once``):

1. The inbox prefix is listed (all pages; S3 listings are strongly consistent). Folder markers
   (keys ending in ``/``), spec files and anything under the done/failed prefixes are skipped.
2. Its spec is found (see "Spec files"); an object with no usable spec is left alone, unclaimed,
   and picked up by a later poll once the spec is there or fixed.
3. It is claimed: one row per (bucket, key, etag) in ``drop_claims``, won by exactly one
   INSERT .. ON CONFLICT DO NOTHING RETURNING across all watchers and all time. Losers skip it.
4. With a done prefix, the claimed version is copied to ``<done>/<claim id>/<path under inbox>``
   first (``CopySourceIfMatch`` the claimed ETag, so exactly that content moves), and the job is
   submitted with THAT uri: ingest runs later, on another machine, and the inbox key is deleted
   right after the job exists. The claim id in the path keeps a later upload under the same name
   from overwriting what a queued job still has to read. Without a done prefix the job gets the
   inbox uri and the object stays where it is.
5. ``submit([uri], spec)`` creates the job; its id goes on the claim (``submitted``). Only then is
   the inbox object deleted (``IfMatch`` the claimed ETag: a newer upload under the same key is
   never deleted unprocessed) and the claim marked ``done``.
   If submit raises, the claim is marked ``failed`` with the error, the done/ copy is removed
   and the object moved to ``<failed>/<claim id>/<path under inbox>`` (when a failed prefix is set).

Exactly once: several watchers may poll the same prefix concurrently; the claim row decides.
Dropping the same bytes again (same ETag) never makes a second job; a re-drop of identical
content whose claim is done/failed is simply moved on (done/ or failed/) again. Uploading new
content under the same key gives a new ETag, hence a new claim and a new job. (An ETag is what S3
reports for an upload: identical bytes uploaded in multipart with another part size get another
ETag and count as new.) To retry an object whose submit failed, delete its claim row and drop it
again. A watcher that crashes between claim and submit leaves the claim ``claimed``: it is not
retried automatically (it cannot know whether the job was created) - at most once rather than
twice; such claims are visible by status and age.

Spec files (prompts, schema, sampling... as JSON, the fields of ``JobSpec``):

* ``<object name>.spec.json`` beside an object applies to that object only
  (``inbox/a.pdf.spec.json`` for ``inbox/a.pdf``);
* otherwise ``_spec.json`` in the object's folder, or else in the nearest folder above it up to
  the inbox root, applies to every object below that folder;
* otherwise ``default_spec``. A spec file's fields override the default spec's (top-level keys).

Upload a folder's spec before its objects (or run without a default spec, so that objects wait
for theirs): an object is claimed with the spec in force when it is seen.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ingest.spec import JobSpec
from storage.db import Database
from storage.models import ClaimStatus
from storage.object_store import S3ObjectStore, is_not_found, make_s3_client, parse_s3_url
from storage.repository import claim_object, find_claim, set_claim

log = logging.getLogger(__name__)

SPEC_SUFFIX = ".spec.json"
FOLDER_SPEC = "_spec.json"
MAX_SPEC_BYTES = 1024 * 1024

Submit = Callable[[list[str], JobSpec], str]


@dataclass(frozen=True, slots=True)
class DropObject:
    key: str
    etag: str  # as S3 lists it, quotes included
    size: int


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _is_spec(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return name == FOLDER_SPEC or name.endswith(SPEC_SUFFIX)


def _folder_prefix(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError("a done/failed prefix must not be the bucket root")
    return prefix + "/"


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
    ) -> None:
        # An S3ObjectStore lends its client; anything else is taken to be a boto3 S3 client.
        # Not the store's own methods: dropped objects have user names (spaces, accents) that
        # visbatch's content keys never have.
        self.client = s3.client if isinstance(s3, S3ObjectStore) else s3
        self.db = db
        self.bucket, prefix = parse_s3_url(prefix_url)
        self.prefix = prefix + "/" if prefix else ""
        self.submit = submit
        self.default_spec = default_spec
        self.done_prefix = _folder_prefix(done_prefix)
        self.failed_prefix = _folder_prefix(failed_prefix)
        self.poll_seconds = poll_seconds
        for moved in (self.done_prefix, self.failed_prefix):
            if moved is not None and self.prefix.startswith(moved):
                raise ValueError(f"the inbox {prefix_url!r} lies inside the {moved!r} prefix")
        # Spec problems are logged once per spec version, not once per poll.
        self._reported: set[tuple[str, str]] = set()

    @classmethod
    def from_url(cls, prefix_url: str, db: Database, submit: Submit, **kwargs: Any) -> DropFolderWatcher:
        endpoint_url = kwargs.pop("endpoint_url", None)
        return cls(make_s3_client(endpoint_url), db, prefix_url, submit, **kwargs)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """poll_once every ``poll_seconds`` until ``stop_event`` is set; a failed poll is logged
        and retried at the next interval (S3 or the database may be briefly away)."""
        log.info("watching s3://%s/%s every %.1f s", self.bucket, self.prefix, self.poll_seconds)
        while not stop_event.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("drop-folder poll of s3://%s/%s failed", self.bucket, self.prefix)
            stop_event.wait(self.poll_seconds)

    def poll_once(self) -> list[str]:
        """One pass over the inbox; returns the ids of the jobs this call created."""
        objects, specs = self._list()
        # Concurrent watchers list the same keys: a different order per watcher spreads the work
        # instead of having them all queue on the same claim row.
        random.shuffle(objects)
        spec_cache: dict[str, JobSpec | None] = {}
        created = []
        for obj in objects:
            spec = self._spec_for(obj, specs, spec_cache)
            if spec is None:
                continue
            try:
                job_id = self._process(obj, spec)
            except Exception:  # one object's trouble must not stop the rest of the pass
                log.exception("drop folder: s3://%s/%s could not be processed", self.bucket, obj.key)
                continue
            if job_id is not None:
                created.append(job_id)
        return created

    # -- listing and specs -------------------------------------------------------------------

    def _excluded(self, key: str) -> bool:
        return any(p is not None and key.startswith(p) for p in (self.done_prefix, self.failed_prefix))

    def _list(self) -> tuple[list[DropObject], dict[str, str]]:
        objects: list[DropObject] = []
        specs: dict[str, str] = {}  # spec key -> etag
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                key = item["Key"]
                if key.endswith("/") or self._excluded(key):
                    continue  # folder marker, or already moved on
                if _is_spec(key):
                    specs[key] = item["ETag"]
                else:
                    objects.append(DropObject(key, item["ETag"], int(item.get("Size", 0))))
        return objects, specs

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
        self, obj: DropObject, specs: dict[str, str], cache: dict[str, JobSpec | None]
    ) -> JobSpec | None:
        spec_key = self._spec_key_for(obj.key, specs)
        if spec_key is None:
            if self.default_spec is None:
                self._report(obj.key, obj.etag, "no spec file and no default spec: waiting for one")
            return self.default_spec
        if spec_key not in cache:
            cache[spec_key] = self._read_spec(spec_key, specs[spec_key])
        return cache[spec_key]

    def _read_spec(self, spec_key: str, etag: str) -> JobSpec | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=spec_key, IfMatch=etag)
            with response["Body"] as body:
                raw = body.read(MAX_SPEC_BYTES + 1)
            if len(raw) > MAX_SPEC_BYTES:
                raise ValueError(f"over {MAX_SPEC_BYTES} bytes")
            fields = json.loads(raw)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            base = self.default_spec.model_dump(mode="json") if self.default_spec is not None else {}
            return JobSpec.model_validate({**base, **fields})
        except Exception as exc:  # a bad spec must not stop the other folders
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._report(spec_key, etag, f"unusable spec file ({reason}); its objects wait")
            return None

    def _report(self, key: str, etag: str, message: str) -> None:
        if (key, etag) not in self._reported:
            if len(self._reported) >= 10_000:  # a long-running watcher must not grow without bound
                self._reported.clear()
            self._reported.add((key, etag))
            log.warning("drop folder: s3://%s/%s: %s", self.bucket, key, message)

    # -- one object --------------------------------------------------------------------------

    def _target(self, prefix: str, claim_id: int, key: str) -> str:
        return f"{prefix}{claim_id}/{key[len(self.prefix) :]}"

    def _process(self, obj: DropObject, spec: JobSpec) -> str | None:
        etag = obj.etag.strip('"')
        claim_id = claim_object(self.db, self.bucket, obj.key, etag)
        if claim_id is None:
            self._settle_earlier_claim(obj, etag)
            return None

        uri_key = obj.key
        if self.done_prefix is not None:
            uri_key = self._target(self.done_prefix, claim_id, obj.key)
            try:
                self._copy(obj, uri_key)
            except Exception as exc:
                self._fail(claim_id, obj, f"could not copy to {uri_key}: {type(exc).__name__}: {exc}")
                return None
        try:
            job_id = self.submit([f"s3://{self.bucket}/{uri_key}"], spec)
        except Exception as exc:
            self._fail(claim_id, obj, f"submit failed: {type(exc).__name__}: {exc}")
            if uri_key != obj.key:
                self._discard(uri_key)  # no job will ever read this copy
            return None
        set_claim(self.db, claim_id, status=ClaimStatus.SUBMITTED, job_id=job_id)
        if self.done_prefix is not None:
            self._delete_version(obj)
        set_claim(self.db, claim_id, status=ClaimStatus.DONE)
        log.info("drop folder: s3://%s/%s -> job %s", self.bucket, obj.key, job_id)
        return job_id

    def _fail(self, claim_id: int, obj: DropObject, error: str) -> None:
        log.warning("drop folder: s3://%s/%s: %s", self.bucket, obj.key, error)
        set_claim(self.db, claim_id, status=ClaimStatus.FAILED, error=error)
        if self.failed_prefix is not None:
            try:
                self._copy(obj, self._target(self.failed_prefix, claim_id, obj.key))
                self._delete_version(obj)
            except Exception as exc:  # the claim already says failed; the object just stays
                log.warning(
                    "drop folder: could not move s3://%s/%s to failed/: %s", self.bucket, obj.key, exc
                )

    def _settle_earlier_claim(self, obj: DropObject, etag: str) -> None:
        """This version was claimed before: finish a move that was cut short, or move on a re-drop of
        content already handled. A claim still ``claimed`` belongs to a watcher at work (or one that
        crashed): left alone."""
        claim = find_claim(self.db, self.bucket, obj.key, etag)
        if claim is None or claim.status == ClaimStatus.CLAIMED:
            return
        if claim.status == ClaimStatus.FAILED:
            if self.failed_prefix is not None:
                try:
                    self._copy(obj, self._target(self.failed_prefix, claim.id, obj.key))
                except Exception as exc:
                    if is_not_found(exc):
                        return  # our listing was stale: another watcher moved it meanwhile
                    raise
                self._delete_version(obj)
            return
        if self.done_prefix is not None:
            # submitted or done: the done/ copy was made before the job was; only the delete is left.
            log.info("drop folder: s3://%s/%s already went to job %s", self.bucket, obj.key, claim.job_id)
            self._delete_version(obj)
            if claim.status != ClaimStatus.DONE:
                set_claim(self.db, claim.id, status=ClaimStatus.DONE)

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
            log.warning("drop folder: could not delete s3://%s/%s: %s", self.bucket, key, exc)

    def _delete_version(self, obj: DropObject) -> None:
        """Delete the inbox key if it still holds the claimed version."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=obj.key, IfMatch=obj.etag)
        except Exception as exc:
            code = _error_code(exc)
            if is_not_found(exc):
                return  # another watcher finished the move
            if code == "PreconditionFailed":
                return  # new content under this key: it gets its own claim
            if code == "NotImplemented":  # a store without conditional deletes
                self.client.delete_object(Bucket=self.bucket, Key=obj.key)
                return
            raise
