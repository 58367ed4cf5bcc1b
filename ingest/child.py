"""The process that splits sources: `python -m ingest.child`, driven by ingest.isolation.

PDF and video parsers are large C libraries fed untrusted bytes; here a crash, a runaway
allocation or an endless loop costs this process only, and the worker that drives it records
a clear error on the source and goes on. Requests and replies are JSON lines (no pickle):

  request:  {"id", "path", "options", "limits", "store_url", "endpoint_url", "processes" (optional, 1),
             "selection" (optional: a range of a PDF's pages, ingest.units.UnitSelection)}
  replies:  {"source": {kind, sha256, size, units}}, then {"unit": {...}} | {"failure": {...}} ...,
            then {"done": true}; or {"source_error": "..."} at any point

Every reply carries `"request": id`, and every unit and failure the source's `"sha256"`: the
reader checks both, so a reply left over from an abandoned request can never pass for a page
of the next source (the reader also kills a child whose request it stops reading early).

Detection runs here too: it hands the bytes to FFmpeg, which is as exposed as any decoder.
With "processes" > 1 the pages of a PDF are rendered by that many processes forked from this
one (ingest.spread), under the same memory cap each.

Ctrl-C is not ours to act on: a terminal sends SIGINT to its whole process group, this child
too, and it printed a `KeyboardInterrupt` traceback on every Ctrl-C of a run (issue 31). The
child ignores it, as its page renderers do; its parent decides: a run's stop kills it, a fleet
worker's warm shutdown lets the source in hand finish. A parent that is gone (a second Ctrl-C
leaves at once) ends it too, quietly: its input ends, or its next reply meets a closed pipe.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # before the imports below: PyMuPDF and PyAV take most of a second
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import json  # noqa: E402 - after the signal, see above
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from functools import cache, partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TextIO  # noqa: E402

from ingest.detect import detect_kind  # noqa: E402
from ingest.frames import frame_signature  # noqa: E402
from ingest.limits import Limits  # noqa: E402
from ingest.spec import IngestOptions  # noqa: E402
from ingest.split import planned_units  # noqa: E402
from ingest.spread import spread_units  # noqa: E402
from ingest.stage import file_sha256, store_image  # noqa: E402
from ingest.units import RenderedImage, SourceError, UnitFailure, UnitSelection  # noqa: E402
from storage.object_store import ObjectStore, open_object_store  # noqa: E402


@cache
def _store(url: str, endpoint_url: str | None, pid: int) -> ObjectStore:
    # One per process: a process forked to render pages (ingest.spread) must not share the
    # parent's pooled S3 connections.
    return open_object_store(url, endpoint_url=endpoint_url)


def _split(request: dict[str, Any], out: TextIO) -> None:
    request_id = request.get("id")

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps({**message, "request": request_id}) + "\n")

    limits = Limits(**request["limits"])
    options = IngestOptions(**request["options"])
    path = Path(request["path"])
    selection = UnitSelection.from_json(request.get("selection"))
    try:
        kind = detect_kind(path)
        sha256, size = file_sha256(path)
        units = planned_units(path, kind, options, limits)
        reply({"source": {"kind": kind, "sha256": sha256, "size": size, "units": units}})
        store = partial(_stored, request["store_url"], request.get("endpoint_url"), kind)
        processes = int(request.get("processes", 1))
        replies = spread_units(
            path, kind, options, store, limits=limits, processes=processes, selection=selection
        )
        for record in replies:
            for body in record.values():  # {"unit": {...}} or {"failure": {...}}
                body["sha256"] = sha256
            reply(record)
        reply({"done": True})
    except SourceError as exc:
        reply({"source_error": str(exc)})
    except BrokenPipeError:
        raise  # the parent is gone: not the source's fault (main ends us)
    except MemoryError:
        reply({"source_error": f"out of memory (over {limits.memory_bytes >> 20} MiB)"})
    except Exception as exc:
        retry = _retryable(exc)
        if retry is not None:  # a full disk, a store away: the parent's runner tries it again
            reply({"retry": retry})
        else:  # a parser bug on a hostile file: that source fails, the process goes on
            reply({"source_error": f"{type(exc).__name__}: {exc}"})
    out.flush()


def _retryable(exc: Exception) -> dict[str, Any] | None:
    """A transient error (storage.errors: a full disk, the store away) as the parent raises it
    again (ingest.isolation.retryable_error); None for a failure of the source itself."""
    from storage.errors import is_transient

    if not is_transient(exc):
        return None
    error = exc if isinstance(exc, OSError) else None
    return {
        "message": f"{type(exc).__name__}: {exc}",
        "errno": error.errno if error is not None else None,
        "filename": str(error.filename) if error is not None and error.filename else None,
    }


def _stored(
    store_url: str, endpoint_url: str | None, kind: str, item: RenderedImage | UnitFailure
) -> dict[str, Any]:
    """Store one unit's image; the reply that reports it (run where the unit was rendered)."""
    if isinstance(item, UnitFailure):
        return {"failure": {"index": item.index, "message": item.message, "timestamp": item.timestamp}}
    key = store_image(_store(store_url, endpoint_url, os.getpid()), item.image)
    width, height = item.image.size
    unit = {"index": item.index, "width": width, "height": height, "image_key": key,
            "timestamp": item.timestamp, "text": item.text}  # fmt: skip
    if kind == "video":  # redundant-frame skipping needs the pixels, which only we have
        unit["signature"] = frame_signature(item.image)
    return {"unit": unit}


def main() -> None:
    memory = int(os.environ.get("VISBATCH_CHILD_MEMORY_BYTES", Limits().memory_bytes))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # Replies get the real stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        for line in sys.stdin:
            if line.strip():
                _split(json.loads(line), out)
    except BrokenPipeError:
        # The parent left without waiting for us. os._exit: a normal exit would flush `out` into
        # the closed pipe again and print "Exception ignored ... BrokenPipeError".
        os._exit(0)


if __name__ == "__main__":
    main()
