"""Redundant video frames: on a clip with static and moving parts, exactly the static repeats are
skipped (recorded with their reason and the kept frame they repeat), through the real ingest."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image
from sqlalchemy import Row, select

from ingest.budget import VisualBudget
from ingest.frames import RedundantFrames, frame_signature, signature_distance
from ingest.spec import IngestOptions, JobSpec
from storage import repository as repo
from storage.models import UNITS, UnitStatus
from worker.drivers.embedded import ingest_only
from worker.runtime import Runtime

MOVING = (3.0, 5.0)  # seconds during which a red square crosses the picture


def write_static_and_moving(path: Path, seconds: int = 8, fps: int = 10, size=(320, 240)) -> Path:
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 90)], axis=-1).astype(np.uint8)
    base[150:200, 200:300] = (20, 160, 40)  # a static object
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = base.copy()
            t = i / fps
            if MOVING[0] <= t < MOVING[1]:
                left = int((t - MOVING[0]) * 120)
                frame[40:100, left : left + 60] = (255, 0, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _units(rt: Runtime, job_id: str) -> list[Row]:
    with rt.db.session(readonly=True) as session:
        stmt = select(UNITS).where(UNITS.c.job_id == job_id).order_by(UNITS.c.unit_index)
        return list(session.execute(stmt).all())


def _ingest(settings_factory, path: Path, budget: VisualBudget) -> tuple[Runtime, str]:
    rt = Runtime(settings_factory())
    spec = JobSpec(prompts=["What happens?"], ingest=IngestOptions(fps=2.0), budget=budget)
    return rt, ingest_only(rt, [path], spec)


@pytest.mark.slow
def test_static_frames_are_skipped_moving_ones_kept(settings_factory, tmp_path):
    path = write_static_and_moving(tmp_path / "clip.mp4")
    rt, job_id = _ingest(settings_factory, path, VisualBudget())
    try:
        units = _units(rt, job_id)
        assert len(units) == 16  # 8 s at 2 fps
        kept = {u.timestamp for u in units if u.status == UnitStatus.PENDING}
        skipped = {u.timestamp for u in units if u.status == UnitStatus.SKIPPED}
        moving = {u.timestamp for u in units if MOVING[0] <= u.timestamp < MOVING[1]}
        # The first frame, every moving frame, and the first frame after the square leaves.
        assert kept == {0.0, *moving, MOVING[1]}
        assert skipped == {u.timestamp for u in units} - kept
        by_index = {u.unit_index: u for u in units}
        for unit in units:
            if unit.status == UnitStatus.SKIPPED:
                assert "near-duplicate of frame" in unit.skip_reason
                assert by_index[unit.duplicate_of].status == UnitStatus.PENDING
                assert by_index[unit.duplicate_of].timestamp < unit.timestamp
                assert unit.visual_tokens is None and unit.full_tokens == 99  # 320x240
        tokens = repo.job_summary(rt.db, job_id)["tokens"]
        assert tokens["units_skipped"] == len(skipped)
        assert tokens["saved"]["skipped_frames"] == 99 * len(skipped)
        assert repo.units_in_state(rt.db, job_id, UnitStatus.PENDING) and all(
            u.timestamp in kept for u in repo.units_in_state(rt.db, job_id, UnitStatus.PENDING)
        )
    finally:
        rt.close()

    # The off switch keeps every frame.
    rt, job_id = _ingest(settings_factory, path, VisualBudget(skip_redundant_frames=False))
    try:
        assert all(u.status == UnitStatus.PENDING for u in _units(rt, job_id))
    finally:
        rt.close()


def test_skip_rule_compares_with_the_last_kept_frame():
    grey = [Image.new("RGB", (64, 48), (v, v, v)) for v in (100, 101, 102, 103, 104)]
    signatures = [frame_signature(img) for img in grey]
    assert signature_distance(signatures[0], signatures[4]) == pytest.approx(4.0)
    frames = RedundantFrames(threshold=2.5)
    decisions = [frames.check(i, s) for i, s in enumerate(signatures)]
    # 101 and 102 repeat 100; 103 is 3 levels from 100, kept; 104 repeats 103: a slow drift adds up.
    assert [d is None for d in decisions] == [True, False, False, True, False]
    assert decisions[4].duplicate_of == 3
