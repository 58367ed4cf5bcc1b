"""The pages of one PDF over several processes (ingest.spread): same units, same order, and a
crashed or stalled process fails the source cleanly (nothing left running)."""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from ingest.isolation import IsolatedSplitter, StoredUnit
from ingest.limits import Limits
from ingest.spec import IngestOptions
from ingest.spread import spread_units
from ingest.stage import image_hash
from ingest.units import RenderedImage, SourceError, UnitFailure
from tests.media import write_encrypted_pdf, write_pdf, write_slow_pdf, write_video

OPTIONS = IngestOptions(longest_side=200)


def describe(unit: RenderedImage | UnitFailure) -> dict:
    """A handler: runs in the process that rendered the unit; returns JSON."""
    if isinstance(unit, UnitFailure):
        return {"index": unit.index, "error": unit.message}
    return {"index": unit.index, "pid": os.getpid(), "hash": image_hash(unit.image), "text": unit.text}


def _records(path: Path, processes: int, options: IngestOptions = OPTIONS, **kw) -> list[dict]:
    return list(spread_units(path, "pdf", options, describe, processes=processes, **kw))


def _leftover_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


def test_three_processes_give_the_pages_of_one_in_page_order(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=11)
    alone = _records(pdf, 1)
    spread = _records(pdf, 3)
    strip = [{k: v for k, v in r.items() if k != "pid"} for r in spread]
    assert strip == [{k: v for k, v in r.items() if k != "pid"} for r in alone]
    assert [r["index"] for r in spread] == list(range(11))
    assert len({r["pid"] for r in spread}) == 3 and os.getpid() not in {r["pid"] for r in spread}
    assert {r["pid"] for r in alone} == {os.getpid()}
    assert _leftover_children() == []


def test_a_page_selection_is_spread_too_and_never_over_more_processes_than_pages(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=9)
    chosen = _records(pdf, 4, IngestOptions(longest_side=200, pages="2-3,8"))
    assert [r["index"] for r in chosen] == [1, 2, 7]
    assert len({r["pid"] for r in chosen}) == 3
    single = _records(pdf, 4, IngestOptions(longest_side=200, pages="5"))
    assert [(r["index"], r["pid"]) for r in single] == [(4, os.getpid())]  # one page: no fork


def test_a_source_error_is_raised_once_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="encrypted"):
        _records(write_encrypted_pdf(tmp_path / "locked.pdf"), 4)
    with pytest.raises(SourceError, match="over the limit of 3"):
        _records(write_pdf(tmp_path / "doc.pdf", pages=5), 2, limits=Limits(max_pdf_pages=3))
    assert _leftover_children() == []


def test_videos_and_images_are_split_here(tmp_path: Path) -> None:
    clip = write_video(tmp_path / "clip.mp4", seconds=2)
    frames = list(spread_units(clip, "video", IngestOptions(fps=1.0), describe, processes=4))
    assert [f["index"] for f in frames] == [0, 1] and {f["pid"] for f in frames} == {os.getpid()}


def crash_on_page_4(unit: RenderedImage | UnitFailure) -> dict:
    if unit.index == 4:
        faulthandler.disable()  # pytest's, inherited: no stack dump in the test output
        os.kill(os.getpid(), signal.SIGSEGV)  # what a parser bug on a hostile page does
    return describe(unit)


def test_a_crashing_process_fails_the_source_after_the_pages_before(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=8)
    got = []
    with pytest.raises(SourceError, match=r"crashed on this file \(signal 11\) after 4 page"):
        for record in spread_units(pdf, "pdf", OPTIONS, crash_on_page_4, processes=2):
            got.append(record["index"])
    assert got == [0, 1, 2, 3]
    assert _leftover_children() == []


def stall_on_page_1(unit: RenderedImage | UnitFailure) -> dict:
    if unit.index == 1:
        time.sleep(3600)
    return describe(unit)


def test_a_stalled_process_is_stopped_at_the_unit_timeout(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=4)
    started = time.monotonic()
    with pytest.raises(SourceError, match="no page finished within 1 s after 1 page"):
        list(spread_units(pdf, "pdf", OPTIONS, stall_on_page_1, limits=Limits(unit_timeout_s=1), processes=2))
    assert time.monotonic() - started < 10
    assert _leftover_children() == []


def test_a_failing_handler_fails_the_source_with_its_message(tmp_path: Path) -> None:
    def full_disk(unit: RenderedImage | UnitFailure) -> dict:
        raise OSError(28, "No space left on device")

    with pytest.raises(SourceError, match="No space left on device"):
        list(spread_units(write_pdf(tmp_path / "doc.pdf", pages=4), "pdf", OPTIONS, full_disk, processes=2))


def test_rendering_processes_die_with_their_parent_even_by_sigkill(tmp_path: Path) -> None:
    """The sandbox SIGKILLs a stalled splitter: the processes it forked must not live on."""
    pdf = write_pdf(tmp_path / "doc.pdf", pages=4)
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from ingest.spec import IngestOptions
        from ingest.spread import spread_units
        def stall(unit):
            os.write(1, b"pid %d\\n" % os.getpid())  # one write: the two never interleave
            time.sleep(3600)
        list(spread_units({str(pdf)!r}, "pdf", IngestOptions(longest_side=100), stall, processes=2))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    try:
        workers: list[int] = []
        while len(workers) < 2:
            line = parent.stdout.readline()
            assert line, "the script ended before both processes started"
            if line.startswith("pid "):  # anything else a library prints on stdout is not a pid
                workers.append(int(line.split()[1]))
        assert all(psutil.pid_exists(pid) for pid in workers)
    finally:
        parent.kill()  # even when the test fails: a stalled parent must not outlive it
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_sandboxed_child_spreads_pages_the_same_way(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "doc.pdf", pages=6)
    results = {}
    for processes in (1, 3):
        with IsolatedSplitter(f"file://{tmp_path / 'store'}", processes=processes) as splitter:
            units = [u for u in splitter.split(pdf, OPTIONS) if isinstance(u, StoredUnit)]
        results[processes] = [json.dumps(u.__dict__, sort_keys=True) for u in units]
    assert len(results[1]) == 6 and results[3] == results[1]


def test_a_kill_from_another_thread_ends_the_read_at_once(tmp_path: Path) -> None:
    """How a stopping run stops its renders: kill() from the stop watcher's thread while this
    thread waits for the next page. The read ends with the child's death, not at the unit
    timeout (closing the pipe under the reader's select made it sleep the timeout out)."""
    pdf = write_slow_pdf(tmp_path / "slow.pdf", pages=6)  # ~4 s to split at 1800 px
    store = f"file://{tmp_path / 'store'}"
    splitter = IsolatedSplitter(store, limits=Limits(unit_timeout_s=120), processes=2)
    items = splitter.split(pdf, IngestOptions(longest_side=1800))
    next(items)  # the source's facts: the child is rendering
    killer = threading.Timer(0.2, splitter.kill)
    killer.start()
    started = time.monotonic()
    with pytest.raises(SourceError, match="signal 9"):
        for _ in items:
            pass
    assert time.monotonic() - started < 30  # the unit timeout (120 s) is what the bug waited for
    killer.join()
    splitter.close()


def collect_then_describe(unit: RenderedImage | UnitFailure) -> dict:
    gc.collect()  # what any allocation in the child may trigger
    return describe(unit)


def test_garbage_from_a_decoded_video_is_never_finalized_in_a_rendering_process(tmp_path: Path) -> None:
    """A PyAV decoder left in a reference cycle, freed in a forked child, joins decoder threads the
    child does not have and hangs it (seen: `visbatch ingest clip.mp4 doc.pdf`)."""
    import av

    clip = write_video(tmp_path / "clip.mp4", seconds=2)
    gc.disable()
    try:
        container = av.open(str(clip))
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        next(container.decode(stream))
        cycle: dict = {"container": container}
        cycle["self"] = cycle  # unreachable once dropped, yet only the collector frees it
        del cycle, container, stream
        records = list(
            spread_units(
                write_pdf(tmp_path / "doc.pdf", pages=4), "pdf", OPTIONS, collect_then_describe,
                limits=Limits(unit_timeout_s=20), processes=2,
            )
        )  # fmt: skip
    finally:
        gc.enable()
    assert [r["index"] for r in records] == [0, 1, 2, 3]
