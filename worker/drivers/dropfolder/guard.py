"""What a drop-folder watcher must never take for dropped files: the object store, the token cache,
and the folders other watchers own.

A watcher moves (copies, then deletes) every object under its inbox prefix. Pointed at a prefix
that holds visbatch's own store (``watch s3://bucket/`` with ``VISBATCH_STORE_URL=s3://bucket/store``)
it would move the page images and cached tokens that running jobs read, and make a job of each.
So a watcher refuses to start, with one line saying why, when:

* its inbox, done or failed prefix overlaps the object store or the token cache (same bucket,
  one prefix inside the other), or its inbox lies inside its own done or failed folder:
  ``watch_layout``, before anything is read (the command line checks it before it opens the
  database);
* its inbox holds a folder another watcher owns (its done or failed folder, or its inbox), or its
  own folders lie inside another watcher's inbox: ``check_markers``. Each watcher marks the
  folders it owns with a small ``.visbatch-watcher.json`` object when it starts, so the next one
  can tell;
* its inbox holds objects that a watcher moved there, recognised from the claim rows (a
  ``<folder>/<claim id>/<name>`` key whose claim was that name): ``moved_folders``. This catches the
  done folders of watchers older than the markers.

A marker never expires: the objects in a done folder are what queued jobs read, whether or not
their watcher still runs. A marker left by a watcher that is gone for good is deleted by hand
(the refusal names it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from storage.db import Database
from storage.object_store import parse_s3_url
from worker.drivers.dropfolder.keys import display_key

MARKER_NAME = ".visbatch-watcher.json"
MAX_MOVED_CANDIDATES = 1000  # claim ids looked up at start: enough to recognise a moved folder
MAX_FOLDER_BYTES = 512  # a done/failed folder: <folder>/<claim id>/ + a shortened name fits S3's 1,024 bytes


class WatcherRefused(ValueError):
    """This watcher must not run with this layout; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class Area:
    """A named part of a bucket: ``prefix`` is '' (the whole bucket) or ends with '/'."""

    name: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{display_key(self.prefix)}"


def s3_area(name: str, url: str | None) -> Area | None:
    """The area of an s3:// URL (None for anything else: a local folder, Redis)."""
    if not url or urlparse(url).scheme != "s3":
        return None
    parsed = urlparse(url)
    prefix = parsed.path.strip("/")
    return Area(name, parsed.netloc, prefix + "/" if prefix else "")


def overlaps(a: str, b: str) -> bool:
    """Two folder prefixes ('' or ending in '/') overlap when one lies inside the other."""
    return a.startswith(b) or b.startswith(a)


@dataclass(frozen=True, slots=True)
class Layout:
    """A watcher's inbox and the folders it moves objects to (None where objects stay)."""

    inbox: Area
    done: Area | None
    failed: Area | None

    @property
    def moved(self) -> list[Area]:
        return [area for area in (self.done, self.failed) if area is not None]


def watch_layout(
    prefix_url: str,
    done_prefix: str | None,
    failed_prefix: str | None,
    protected: Mapping[str, str | None],
) -> Layout:
    """The inbox of ``prefix_url`` and its done/failed folders (bucket-relative prefixes), checked
    against each other and against ``protected`` (``{what: url}``: the object store, the token
    cache). Reads nothing. Raises StoreUrlError for a prefix that is no s3:// URL, WatcherRefused
    for a layout the watcher must not run with, ValueError for an unusable done/failed prefix."""
    bucket, prefix = parse_s3_url(prefix_url)
    inbox = Area("inbox", bucket, prefix + "/" if prefix else "")
    done = _moved_area("done", bucket, done_prefix)
    layout = Layout(inbox, done, _moved_area("failed", bucket, failed_prefix))
    for area in layout.moved:
        if inbox.prefix.startswith(area.prefix):
            raise WatcherRefused(f"refusing to watch {inbox.url}: it lies inside the {area.name} {area.url}")
    areas = [s3_area(name, url) for name, url in protected.items()]
    for area in (a for a in areas if a is not None):
        for own in (inbox, *layout.moved):
            if own.bucket == area.bucket and overlaps(own.prefix, area.prefix):
                where = "lies inside" if own.prefix.startswith(area.prefix) else "contains"
                raise WatcherRefused(
                    f"refusing to watch {inbox.url}: the {own.name} {own.url} {where} {area.name} "
                    f"{area.url}, whose objects the watcher would move; give them separate prefixes"
                )
    return layout


def _moved_area(role: str, bucket: str, prefix: str | None) -> Area | None:
    """The done or failed folder of a watcher, None where objects stay where they are."""
    if prefix is None:
        return None
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError(f"--{role}-prefix: a done/failed prefix must not be the bucket root")
    if len(prefix.encode()) > MAX_FOLDER_BYTES or any(ord(ch) < 32 or ord(ch) == 127 for ch in prefix):
        raise ValueError(
            f"--{role}-prefix: a done/failed prefix must be plain text of at most {MAX_FOLDER_BYTES} bytes"
        )
    return Area(f"{role} prefix", bucket, prefix + "/")


def marker_body(role: str, inbox: Area, moved: Iterable[Area]) -> bytes:
    folders = {area.name.split()[0]: f"s3://{area.bucket}/{area.prefix}" for area in moved}
    return json.dumps(
        {"visbatch": "drop-folder watcher", "role": role, "inbox": f"s3://{inbox.bucket}/{inbox.prefix}"}
        | folders
    ).encode()


def read_marker(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The marker at ``key``, None when there is none (or it is not one of ours)."""
    from storage.object_store import is_not_found

    try:
        response = client.get_object(Bucket=bucket, Key=key)
        with response["Body"] as body:
            data = json.loads(body.read(64 * 1024))
    except Exception as exc:
        if is_not_found(exc):
            return None
        if isinstance(exc, ValueError):  # not JSON: someone else's file, not a marker
            return None
        raise
    return data if isinstance(data, dict) and data.get("visbatch") == "drop-folder watcher" else None


def ancestors(prefix: str) -> list[str]:
    """The folders above ``prefix`` (itself excluded), the bucket root ('') first."""
    parts = prefix.rstrip("/").split("/")[:-1] if prefix else []
    return [""] + ["".join(f"{p}/" for p in parts[: i + 1]) for i in range(len(parts))]


def check_markers(client: Any, inbox: Area, moved: list[Area], listed_markers: Iterable[str]) -> None:
    """Refuse when another watcher's folder lies inside this inbox, or this watcher's folders lie
    inside another watcher's inbox. ``listed_markers`` are the marker keys the inbox listing found."""
    inbox_url = f"s3://{inbox.bucket}/{inbox.prefix}"
    own = {inbox.prefix, *(area.prefix for area in moved)}
    for key in listed_markers:
        folder = key[: -len(MARKER_NAME)]
        if folder in own:
            continue
        marker = read_marker(client, inbox.bucket, key)
        if marker is None:
            continue
        role = marker.get("role")
        if role == "inbox" and marker.get("inbox") == inbox_url:
            continue
        raise WatcherRefused(
            f"refusing to watch {inbox.url}: it contains s3://{inbox.bucket}/{display_key(folder)}, "
            f"the {role} folder of the watcher of {display_key(str(marker.get('inbox')))} "
            f"(marker {display_key(MARKER_NAME)}); watch a prefix that does not contain it"
        )
    for area in (inbox, *moved):
        folders = ancestors(area.prefix) if area is inbox else [*ancestors(area.prefix), area.prefix]
        for folder in folders:
            if folder == inbox.prefix:
                continue
            marker = read_marker(client, inbox.bucket, folder + MARKER_NAME)
            if marker is None or marker.get("role") != "inbox" or marker.get("inbox") == inbox_url:
                continue
            raise WatcherRefused(
                f"refusing to watch {inbox.url}: its {area.name} {area.url} lies inside the inbox of "
                f"another watcher, s3://{inbox.bucket}/{display_key(folder)}, which would move its "
                f"objects (if that watcher is gone for good, delete its marker "
                f"s3://{inbox.bucket}/{display_key(folder + MARKER_NAME)})"
            )


def _is_moved_copy(claim_key: str, rest: str) -> bool:
    """Whether ``rest`` is the path a watcher gave its moved copy of ``claim_key``: the path under
    its inbox (a suffix of the key at a '/'), or that path shortened (``drop_keys.moved_key``)."""
    suffixes = [claim_key] + [claim_key[i + 1 :] for i, ch in enumerate(claim_key) if ch == "/"]
    if rest in suffixes:
        return True
    if "/" in rest or "~" not in rest:
        return False
    digest = rest.rsplit("~", 1)[1][:16]
    return any(hashlib.sha256(s.encode()).hexdigest()[:16] == digest for s in suffixes)


def moved_folders(db: Database, bucket: str, keys: Iterable[str]) -> dict[str, str]:
    """Folders among ``keys`` that hold objects a watcher moved there: ``{folder: example key}``.

    A moved object's key is ``<folder><claim id>/<path under its inbox>``; it is recognised when
    claim ``<claim id>`` of this bucket was that object. Only the first ``MAX_MOVED_CANDIDATES``
    claim ids are looked up: a moved folder holds many, one is enough."""
    from storage.claims import claim_keys

    candidates: dict[int, list[tuple[str, str, str]]] = {}
    for key in keys:
        parts = key.split("/")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit() and len(part) <= 19 and part.isascii():
                folder = "".join(f"{p}/" for p in parts[:i])
                candidates.setdefault(int(part), []).append((folder, "/".join(parts[i + 1 :]), key))
        if len(candidates) >= MAX_MOVED_CANDIDATES:
            break
    found: dict[str, str] = {}
    for claim_id, (claim_bucket, claim_key) in claim_keys(db, list(candidates)).items():
        if claim_bucket != bucket:
            continue
        for folder, rest, key in candidates[claim_id]:
            if _is_moved_copy(claim_key, rest):
                found.setdefault(folder, key)
    return found
