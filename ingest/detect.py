"""Tell what a source is from its bytes, never from its name.

Uploads arrive with whatever name the user's tool gave them ("scan.pdf" that is a JPEG,
"video" with no extension), so the file name is not evidence. Images and PDFs are recognised
by their magic bytes; anything else is offered to FFmpeg (PyAV), and is a video only if it
has a real video stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import av

from ingest.units import SourceError, SourceKind

# The PDF spec wants "%PDF-" at offset 0, but readers (and MuPDF) accept junk before it,
# and real-world files carry such junk (mail headers, BOMs); Acrobat looks at 1024 bytes.
PDF_MAGIC = b"%PDF-"
PDF_MAGIC_WINDOW = 1024
HEAD_BYTES = 4096
# Header sizes of the BMP DIB variants (BITMAPCOREHEADER .. BITMAPV5HEADER): "BM" alone is
# two letters, which plain text can start with, so the header size must also fit.
_BMP_DIB_SIZES = {12, 16, 40, 52, 56, 64, 108, 124}


def detect_kind(path: Path) -> SourceKind:
    """Return "pdf", "image" or "video" for the file at ``path``, by content.

    Raises SourceError, with a message fit for the user, when the file is none of them.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            head = fh.read(HEAD_BYTES)
    except FileNotFoundError as exc:
        raise SourceError("file not found") from exc
    except IsADirectoryError as exc:
        raise SourceError("is a directory, not a file") from exc
    except OSError as exc:
        raise SourceError(f"cannot read file: {exc.strerror or exc}") from exc

    if not head:
        raise SourceError("empty file (0 bytes)")
    if _is_image(head):
        return "image"
    if PDF_MAGIC in head[:PDF_MAGIC_WINDOW]:
        return "pdf"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        # FFmpeg would not open it either, but say what it is: users upload zipped folders.
        raise SourceError("not a PDF, video or image (a ZIP archive)")
    _check_video(path, head)
    return "video"


def still_kind(path: Path) -> SourceKind | None:
    """ "pdf" or "image" when the file's first bytes say so; None for anything else (a video,
    or a file that cannot be read: its own source says why, later)."""
    try:
        with Path(path).open("rb") as fh:
            head = fh.read(HEAD_BYTES)
    except OSError:
        return None
    if _is_image(head):
        return "image"
    return "pdf" if PDF_MAGIC in head[:PDF_MAGIC_WINDOW] else None


def _is_image(head: bytes) -> bool:
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return True
    if head.startswith(b"\xff\xd8\xff"):
        return True
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return True
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return True
    return head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_DIB_SIZES


def _check_video(path: Path, head: bytes) -> None:
    """Raise SourceError unless FFmpeg finds a video stream in the file's bytes."""
    try:
        with path.open("rb") as fh:
            # FFmpeg also guesses formats from the file *name* (image2 for "x.bmp", tty for
            # "x.txt", rawvideo for "x.yuv"); a reader without a name leaves it only the bytes.
            container = av.open(_Nameless(fh), mode="r")
            try:
                still = is_still_image_format(container.format.name)
                has_video = any(not is_cover_art(s) for s in container.streams.video)
                has_audio = bool(container.streams.audio)
            finally:
                container.close()
    except Exception as exc:  # any failure to open means "not media we can read"
        if _looks_like_media(head):
            # An MP4 cut short loses its index (moov) at the end: say so, not "unknown type".
            raise SourceError(f"cannot open video (truncated or corrupt?): {describe_av_error(exc)}") from exc
        raise SourceError(f"not a PDF, video or image (starts with {_preview(head)})") from exc
    if has_video and not still:
        return
    if has_audio:
        raise SourceError("media file has no video stream (audio only)")
    if _looks_like_media(head):
        raise SourceError("media file has no video stream (truncated or corrupt?)")
    raise SourceError(f"not a PDF, video or image (starts with {_preview(head)})")


class _Nameless:
    """A binary reader PyAV can use, with no ``name`` for FFmpeg to guess from."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh

    def read(self, size: int = -1) -> bytes:
        return self._fh.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()


def is_still_image_format(format_name: str | None) -> bool:
    """FFmpeg demuxers for single pictures and text art, which are not videos for us.

    Real images never get here (their magic bytes are checked first); these demuxers only
    claim a file on thin evidence, e.g. text that happens to start with "BM".
    """
    names = set((format_name or "").split(","))
    return bool(names & {"image2", "image2pipe", "tty"}) or any(n.endswith("_pipe") for n in names)


def _looks_like_media(head: bytes) -> bool:
    return (
        head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide")  # MP4 / MOV / 3GP
        or head.startswith(b"\x1a\x45\xdf\xa3")  # Matroska / WebM
        or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
        or head.startswith(
            (b"OggS", b"FLV", b"\x00\x00\x01\xba", b"\x30\x26\xb2\x75")
        )  # Ogg, FLV, MPEG-PS, ASF
        or (len(head) > 376 and head[0] == head[188] == head[376] == 0x47)  # MPEG-TS sync bytes
    )


def describe_av_error(exc: BaseException) -> str:
    """FFmpeg's own words ("End of file", "Invalid data found ..."), without errno and path."""
    strerror = getattr(exc, "strerror", None)
    return strerror if isinstance(strerror, str) and strerror else str(exc)


def is_cover_art(stream: av.stream.Stream) -> bool:
    """True for the still picture that audio files (MP3, M4A) carry as a "video" stream."""
    try:
        return bool(stream.disposition & av.stream.Disposition.attached_pic)
    except (AttributeError, TypeError):
        return False


def _preview(head: bytes) -> str:
    """The first bytes, as a Python bytes literal: short, safe to show, and recognisable."""
    return repr(head[:16]) + ("..." if len(head) > 16 else "")
