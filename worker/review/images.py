"""Page and frame images for the review pages: full size straight from the object store, and
thumbnails made on demand with PIL and cached on disk.

A page of 50 units asks for 50 thumbnails at once; a semaphore bounds how many full images are
decoded at the same time, so memory stays flat however large the job. Keys are content hashes
(``images/ab/<sha256>.png``), so a cached thumbnail never goes stale and is shared across jobs.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import threading
from pathlib import Path

from PIL import Image

from storage.object_store import ObjectStore

THUMB_SIDE = 320
THUMB_QUALITY = 80
DECODES_AT_ONCE = 4


def make_thumbnail(source: bytes | Path, side: int = THUMB_SIDE) -> bytes:
    """A JPEG whose longest side is at most ``side`` px."""
    with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
        image.draft("RGB", (side, side))  # JPEG sources decode at a reduced size; PNGs ignore it
        image.thumbnail((side, side))
        rgb = image.convert("RGB")
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=THUMB_QUALITY)
    return buffer.getvalue()


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Thumbnails:
    """Thumbnails of stored images, made once and kept under ``cache_dir``."""

    def __init__(self, store: ObjectStore, cache_dir: Path, side: int = THUMB_SIDE) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self.side = side
        self._decoding = threading.BoundedSemaphore(DECODES_AT_ONCE)

    def _path(self, image_key: str) -> Path:
        digest = hashlib.sha256(image_key.encode()).hexdigest()
        return self.cache_dir / digest[:2] / f"{digest}-{self.side}.jpg"

    def get(self, image_key: str) -> bytes:
        path = self._path(image_key)
        if path.exists():
            return path.read_bytes()
        with self._decoding:
            if path.exists():  # made by another request while this one waited
                return path.read_bytes()
            data = make_thumbnail(self.store.get_bytes(image_key), self.side)
            _write_atomically(path, data)
        return data


def default_thumbnail_dir(home: Path) -> tuple[Path, bool]:
    """``home/review-thumbs`` when it can be created, else a temporary folder (second value: True,
    the caller removes it at exit), e.g. on a read-only fleet machine."""
    folder = home / "review-thumbs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder, False
    except OSError:
        return Path(tempfile.mkdtemp(prefix="visbatch-thumbs-")), True


def copy_image(store: ObjectStore, image_key: str, folder: Path, unit_id: int) -> None:
    """Into a static site: ``img/<unit>.png`` (the stored file, copied) and ``thumb/<unit>.jpg``."""
    full = folder / "img" / f"{unit_id}.png"
    thumb = folder / "thumb" / f"{unit_id}.jpg"
    full.parent.mkdir(parents=True, exist_ok=True)
    thumb.parent.mkdir(parents=True, exist_ok=True)
    store.download_file(image_key, full)
    thumb.write_bytes(make_thumbnail(full))


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
