"""Split one source, the pages of a PDF spread over several processes, results in page order.

Rendering and PNG encoding are CPU-bound and MuPDF renders one page at a time, so one process
keeps one core busy. With n processes each renders every n-th selected page (interleaved, so
costly and cheap pages are shared out evenly) through the same ``split_source`` as everybody,
hands each unit to ``handle`` (which stores or writes the image: the pixels never cross a
process boundary) and sends back the small JSON record it returns. The parent reads the n
pipes in turn, so records come out in page order and no more than a pipe's worth waits.

The processes are forked once the parent has imported everything, so n processes cost one
start-up, and nothing is pickled: a record is JSON. A process that crashes or goes silent for
longer than the unit timeout fails the source, like the sandboxed child (ingest.isolation).
Videos and images are split in this process (a video's frames come from one decoder in order).
"""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ingest.limits import Limits
from ingest.pdf import pdf_page_indices
from ingest.spec import IngestOptions
from ingest.split import DEFAULT_LIMITS, split_source
from ingest.units import RenderedImage, SourceError, SourceKind, UnitFailure, UnitSelection

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
Handler = Callable[[RenderedImage | UnitFailure], dict[str, Any]]


def spread_units(
    path: Path,
    kind: SourceKind,
    options: IngestOptions,
    handle: Handler,
    *,
    limits: Limits = DEFAULT_LIMITS,
    processes: int = 1,
    selection: UnitSelection | None = None,
) -> Iterator[dict[str, Any]]:
    """``handle(unit)`` for every unit of the source, in order; the handler runs where the unit is made.

    Raises SourceError when the source cannot be split (as ``split_source`` does), or when a
    rendering process crashes or stalls; the records yielded before stay valid.
    """
    selection = selection or UnitSelection()
    if kind == "pdf" and processes > 1:
        pages = len(
            selection.pick(pdf_page_indices(path, pages=options.pages, max_pages=limits.max_pdf_pages))
        )
        if min(processes, pages) > 1:
            yield from _in_processes(path, options, handle, limits, min(processes, pages), pages, selection)
            return
    for unit in split_source(path, kind, options, limits, selection):
        yield handle(unit)


def _in_processes(
    path: Path,
    options: IngestOptions,
    handle: Handler,
    limits: Limits,
    count: int,
    pages: int,
    selection: UnitSelection,
) -> Iterator[dict[str, Any]]:
    context = multiprocessing.get_context("fork")
    workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        # A child must never finalize what the parent made: garbage from an earlier video (a
        # PyAV decoder) freed in the child would join decoder threads the child does not have,
        # and hang. Frozen objects are never collected in the child; the parent unfreezes.
        gc.freeze()
        try:
            for shard in range(count):
                reader, writer = context.Pipe(duplex=False)
                args = (writer, path, options, handle, limits, selection, (shard, count), os.getpid())
                process = context.Process(target=_render_shard, args=args, daemon=True)
                process.start()
                writer.close()  # the child's end only: EOF then means the child is gone
                workers.append((process, reader))
        finally:
            gc.unfreeze()
        for position in range(pages):
            process, reader = workers[position % count]
            yield _next_record(process, reader, limits, position)
    finally:
        for process, reader in workers:
            if process.is_alive():
                process.kill()
            process.join()
            reader.close()


def _next_record(
    process: multiprocessing.process.BaseProcess, reader: Connection, limits: Limits, done: int
) -> dict[str, Any]:
    if not reader.poll(limits.unit_timeout_s):
        raise SourceError(
            f"stopped: no page finished within {limits.unit_timeout_s:g} s after {done} page(s) "
            "(hostile or broken file?)"
        )
    try:
        reply = json.loads(reader.recv_bytes())
    except EOFError:
        process.join(5)
        code = process.exitcode
        reason = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise SourceError(f"the renderer crashed on this file ({reason}) after {done} page(s)") from None
    if "source_error" in reply:
        raise SourceError(reply["source_error"])
    return reply["record"]


def _die_with_parent(parent: int) -> None:
    """Be killed when the parent dies, even by SIGKILL (the sandbox kills a stalled splitter so):
    a page stuck in an endless loop must not outlive it. Linux only; elsewhere the next write
    to the closed pipe ends us."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def _render_shard(
    writer: Connection,
    path: Path,
    options: IngestOptions,
    handle: Handler,
    limits: Limits,
    selection: UnitSelection,
    shard: tuple[int, int],
    parent: int,
) -> None:
    """In a forked process: every n-th page, handled, one JSON message each."""
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group: the parent stops us, without n tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for unit in split_source(path, "pdf", options, limits, selection, shard=shard):
            writer.send_bytes(json.dumps({"record": handle(unit)}).encode())
    except SourceError as exc:
        writer.send_bytes(json.dumps({"source_error": str(exc)}).encode())
    except MemoryError:
        writer.send_bytes(json.dumps({"source_error": "out of memory"}).encode())
    except BrokenPipeError:
        pass  # the parent stopped reading (it failed the source, or was stopped)
    except Exception as exc:  # a parser bug on a hostile file, or a full disk: that source fails
        writer.send_bytes(json.dumps({"source_error": f"{type(exc).__name__}: {exc}"}).encode())
    finally:
        writer.close()
