"""Names in a drop folder: where a dropped object moves, where its error note goes, how a key is shown.

Dropped objects carry whatever names people give them, up to S3's limit of 1,024 bytes, with
any character. Two consequences:

* ``done/<claim id>/<path under inbox>`` can be longer than S3 accepts (a 1,020-byte name plus
  ``done/123/``), and a name with control characters is refused by the stage that reads it. The
  moved copy's name is ours to choose, so ``moved_key`` always makes one that fits and that
  every reader accepts: the path as dropped when it can, else a shortened name that keeps the
  start of the file name, its extension, and a hash of the whole original path (so two long
  names never meet, and the original is traceable through the claim row, which keeps it).
* A key in a log line or an error message is shown with ``display_key``: control characters
  escaped (a name must not forge log lines) and long names cut in the middle with their length,
  never repeated whole.
"""

from __future__ import annotations

import hashlib
import re

MAX_KEY_BYTES = 1024  # S3's limit on an object key, in UTF-8 bytes
ERROR_SUFFIX = ".error.json"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MAX_EXTENSION_BYTES = 16


def display_key(key: str, limit: int = 96) -> str:
    """``key`` fit for a message: control characters escaped, cut in the middle past ``limit``
    characters, with the full length in bytes."""
    shown = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", key)
    if len(shown) <= limit:
        return shown
    head = limit * 2 // 3
    tail = limit - head - 3
    return f"{shown[:head]}...{shown[-tail:]} ({len(key.encode()):,} bytes)"


def _truncate_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` of at most ``max_bytes`` UTF-8 bytes (never half a character)."""
    return text.encode()[: max(0, max_bytes)].decode(errors="ignore")


def _split_extension(name: str) -> tuple[str, str]:
    stem, dot, extension = name.rpartition(".")
    if not dot or not stem or len(extension.encode()) >= _MAX_EXTENSION_BYTES:
        return name, ""
    return stem, "." + extension


def fits(key: str) -> bool:
    return 0 < len(key.encode()) <= MAX_KEY_BYTES and not _CONTROL.search(key)


def shortened_name(folder: str, name: str, whole: str, suffix: str = "") -> str:
    """``<folder><start of name>~<hash of whole><extension><suffix>``, at most MAX_KEY_BYTES."""
    digest = hashlib.sha256(whole.encode()).hexdigest()[:16]
    stem, extension = _split_extension(_CONTROL.sub("_", name))
    fixed = f"{folder}~{digest}{extension}{suffix}"
    stem = _truncate_utf8(stem, MAX_KEY_BYTES - len(fixed.encode()))
    return f"{folder}{stem}~{digest}{extension}{suffix}"


def moved_key(prefix: str, claim_id: int, relative: str) -> str:
    """Where a claimed object moves: ``<prefix><claim id>/<relative>`` when that is a key S3 and
    the readers accept, else ``<prefix><claim id>/<shortened file name>`` (see the module doc).

    ``prefix`` ends with '/' and is bounded by the watcher (``guard.MAX_FOLDER_BYTES``), so the
    shortened form always fits."""
    key = f"{prefix}{claim_id}/{relative}"
    if fits(key):
        return key
    return shortened_name(f"{prefix}{claim_id}/", relative.rsplit("/", 1)[-1], relative)


def error_key(subject: str, fallback_folder: str) -> str:
    """The key of the error note beside ``subject``: ``<subject>.error.json`` when it fits, else a
    shortened name in the same folder, else (a folder path near the limit) in ``fallback_folder``."""
    key = subject + ERROR_SUFFIX
    if fits(key):
        return key
    folder, _, name = subject.rpartition("/")
    folder = folder + "/" if folder else ""
    if len(folder.encode()) > MAX_KEY_BYTES - 64 or _CONTROL.search(folder):
        folder = fallback_folder
    return shortened_name(folder, name, subject, ERROR_SUFFIX)
