"""Splitting sources in a child process, with a deadline per page or frame.

A hostile file must not crash or hang the worker: the child (ingest.child) renders, stores
and reports each unit; if it dies, or stays silent longer than the unit timeout, it is killed,
the source fails with a clear message, and the next source gets a fresh child.

The child lives across sources, so its replies must never be read as another source's: each
request has its own id, which every reply carries (with the source's hash on each unit), and a
request that is not read to its end (its reader raised, returned early, or was dropped) kills
the child. A reply that does not match is `SplitterOutOfStep`: the child is killed and the
error raised, never a unit stored (issue 19: a broker restart mid-source once handed the next
job the last one's pages).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ingest.limits import Limits
from ingest.spec import IngestOptions
from ingest.units import SourceError, SourceKind, UnitFailure, UnitSelection
from storage.errors import TransientFault


def retryable_error(retry: dict[str, Any]) -> Exception:
    """The child's transient error raised here again, as the retry policy knows it: an OSError
    with its errno (a full or read-only disk: waited out) or a TransientFault (a store away)."""
    if retry.get("errno") is not None:
        return OSError(int(retry["errno"]), str(retry["message"]), retry.get("filename"))
    return TransientFault(str(retry["message"]))


@dataclass(frozen=True)
class SourceInfo:
    kind: SourceKind
    sha256: str
    size: int
    units: int | None = None  # a PDF's selected pages (before a UnitSelection); None for the rest


@dataclass(frozen=True)
class StoredUnit:
    """A page or frame the child rendered and stored in the object store."""

    index: int
    width: int
    height: int
    image_key: str
    timestamp: float | None = None
    text: str | None = None
    signature: str | None = None  # video frames: 32x32 RGB thumbnail (ingest.frames), for skipping


class SplitterOutOfStep(TransientFault):
    """A reply of the splitting child that does not belong to the request being read: an internal
    fault, not the source's. The child is killed; a retry splits the source again in a fresh one."""


class IsolatedSplitter:
    """Drives one child process; not thread-safe (use one per thread), but for ``kill``."""

    def __init__(
        self,
        store_url: str,
        *,
        endpoint_url: str | None = None,
        limits: Limits | None = None,
        processes: int = 1,
    ) -> None:
        self.store_url = store_url
        self.endpoint_url = endpoint_url
        self.limits = limits or Limits()
        self.processes = processes  # the pages of one PDF are rendered by this many processes
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._reading: str | None = None  # the request whose replies are not all read yet

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "VISBATCH_CHILD_MEMORY_BYTES": str(self.limits.memory_bytes)}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ingest.child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                bufsize=0,
            )
            self._buffer = b""
        return self._proc

    def split(
        self, path: Path, options: IngestOptions, selection: UnitSelection | None = None
    ) -> Iterator[SourceInfo | StoredUnit | UnitFailure]:
        """The source's kind, hash, size and unit count first, then its units (those `selection`
        picks) as the child reports them.

        Raises SourceError when the source (or the child) fails; units reported before stay valid.
        """
        if self._reading is not None or self._buffer:
            # The last request was never read to its end (its reader kept the generator but
            # stopped): the child may still be sending its replies. Never read them as ours.
            self.close()
        proc = self._child()
        request_id = self._reading = uuid.uuid4().hex
        request = {
            "id": request_id,
            "path": str(path),
            "options": options.model_dump(mode="json"),
            "limits": asdict(self.limits),
            "store_url": self.store_url,
            "endpoint_url": self.endpoint_url,
            "processes": self.processes,
            "selection": (selection or UnitSelection()).as_json(),
        }
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
        except BrokenPipeError:
            self.close()
            raise SourceError("the ingest process died before starting this source") from None
        done = 0
        finished = False  # the child's last reply to this request was read
        sha256: str | None = None
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout.fileno(), selectors.EVENT_READ)
                while True:
                    reply = self._next_reply(proc, selector, done)
                    if reply.pop("request", None) != request_id:
                        raise SplitterOutOfStep(
                            f"the splitting process answered another request while splitting {path.name}"
                        )
                    if "source" in reply and sha256 is None:
                        sha256 = reply["source"]["sha256"]
                        yield SourceInfo(**reply["source"])
                    elif "unit" in reply or "failure" in reply:
                        kind = "unit" if "unit" in reply else "failure"
                        body = reply[kind]
                        if sha256 is None or body.pop("sha256", None) != sha256:
                            raise SplitterOutOfStep(
                                f"a {kind} of another file was reported while splitting {path.name}"
                            )
                        done += 1
                        yield StoredUnit(**body) if kind == "unit" else UnitFailure(**body)
                    elif "source_error" in reply:
                        finished = True
                        raise SourceError(reply["source_error"])
                    elif "retry" in reply:
                        finished = True
                        raise retryable_error(reply["retry"])
                    elif reply.get("done"):
                        finished = True
                        return
                    else:
                        raise SplitterOutOfStep(f"an unexpected reply while splitting {path.name}")
        finally:
            if self._reading == request_id:
                self._reading = None
                if not finished and self._proc is proc:
                    # Abandoned mid-source (the consumer raised or stopped early, or a reply did
                    # not match): the child would go on sending this source's replies, and the
                    # next request would read them. Kill it; the next request starts a fresh one.
                    self.close()

    def _next_reply(self, proc: subprocess.Popen, selector: selectors.BaseSelector, done: int) -> dict:
        # Raw reads and our own line buffer: a buffered reader could hold a whole reply that
        # select() then never reports, and we would time out on a healthy child.
        deadline = time.monotonic() + self.limits.unit_timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(timeout=remaining):
                self.close()
                raise SourceError(
                    f"stopped: no page or frame finished within {self.limits.unit_timeout_s:g} s "
                    f"after {done} unit(s) (hostile or broken file?)"
                )
            chunk = os.read(proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
            if not chunk:
                code = proc.wait()
                self.close()
                reason = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise SourceError(
                    f"the renderer crashed on this file ({reason}) after {done} unit(s); "
                    f"memory is capped at {self.limits.memory_bytes >> 20} MiB"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        """Stop the child now, from any thread (a stopping run). The thread reading from it sees
        its pipe close and cleans up; closing the pipe here instead would take it out of that
        thread's select, which then slept out the unit timeout (the forked page renderers still
        held the pipe open for a moment after the child was reaped)."""
        proc = self._proc
        if proc is not None:
            proc.kill()

    def close(self) -> None:
        """Kill the child and close its pipes: from the thread that uses this splitter."""
        if self._proc is not None:
            self._proc.kill()  # the processes it forked to render pages die with it (ingest.spread)
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                if stream is not None:
                    stream.close()
            self._proc = None
        self._buffer = b""
        self._reading = None

    def __enter__(self) -> IsolatedSplitter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
