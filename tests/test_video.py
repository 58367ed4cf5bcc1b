"""sample_video_frames: which frames, their timestamps, seeking, rotation, broken files."""

from __future__ import annotations

import gc
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from ingest import video
from ingest.units import RenderedImage, SourceError, UnitFailure
from ingest.video import plan_targets, sample_video_frames

WIDTH, HEIGHT = 64, 48
CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"


def _frame_array(number: int) -> np.ndarray:
    """Frame ``number`` (< 256) written in binary as 8 white/black blocks along the top."""
    array = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    for bit in range(8):
        if number >> bit & 1:
            array[:16, bit * 8 : bit * 8 + 8] = 255
    array[16:, :, 0] = np.linspace(0, 255, WIDTH, dtype=np.uint8)[None, :]  # texture for pixel diffs
    array[16:, :, 1] = (number * 9) % 256
    return array


def _frame_number(image: Image.Image) -> int:
    pixels = np.asarray(image.convert("L"))
    return sum(1 << bit for bit in range(8) if pixels[8, bit * 8 + 4] > 128)


def _write(
    path: Path,
    seconds: float = 10,
    fps: int = 10,
    *,
    fmt: str | None = None,
    container_options: dict[str, str] | None = None,
    arrays: list[np.ndarray] | None = None,
    rotation: tuple[float, bool] | None = None,
    gop: int | None = None,
) -> Path:
    frames = arrays if arrays is not None else [_frame_array(i) for i in range(int(seconds * fps))]
    height, width = frames[0].shape[:2]
    with av.open(str(path), mode="w", format=fmt, options=container_options or {}) as container:
        stream = container.add_stream(CODEC, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        if CODEC == "libx264":
            stream.options = {"crf": "12", "g": str(gop or fps)}  # a keyframe every second by default
            if gop is not None:  # exactly every `gop` frames: no extra keyframes at scene cuts
                stream.options = {**stream.options, "sc_threshold": "0"}
        else:
            stream.codec_context.gop_size = gop or fps
            stream.bit_rate = 2_000_000
        if rotation is not None:
            stream.set_display_rotation(rotation[0], hflip=rotation[1])
        encoded = []
        for number, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format="yuv420p")
            frame.pts = number
            encoded.append(frame)  # kept alive until muxed (see examples/make_examples.py)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@pytest.fixture(scope="module")
def ten_seconds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("video") / "ten.mp4")


@pytest.fixture(scope="module")
def twenty_seconds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("video") / "twenty.mp4", seconds=20)


def _images(units: list[RenderedImage | UnitFailure]) -> list[RenderedImage]:
    assert all(isinstance(u, RenderedImage) for u in units), units
    return [u for u in units if isinstance(u, RenderedImage)]


# -- which times ---------------------------------------------------------------------------


def test_plan_targets() -> None:
    assert plan_targets(6.0, fps=1.0) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert plan_targets(6.01, fps=1.0)[-1] == 6.0
    assert plan_targets(0.0, fps=1.0) == [0.0]
    assert plan_targets(10.0, num_frames=4) == [1.25, 3.75, 6.25, 8.75]
    capped = plan_targets(100.0, fps=2.0, max_frames=4)
    assert capped == [0.0, 25.0, 50.0, 75.0]  # spread over the whole video, not the first 2 s
    assert plan_targets(3.0, fps=None) == [0.0, 1.0, 2.0]


def test_fps_sampling(ten_seconds: Path) -> None:
    units = _images(list(sample_video_frames(ten_seconds, fps=1.0)))
    assert [u.index for u in units] == list(range(10))
    assert [u.timestamp for u in units] == pytest.approx([float(t) for t in range(10)], abs=1e-6)
    assert [_frame_number(u.image) for u in units] == list(range(0, 100, 10))
    assert all(u.image.size == (WIDTH, HEIGHT) and u.image.mode == "RGB" for u in units)


def test_fractional_fps(ten_seconds: Path) -> None:
    units = _images(list(sample_video_frames(ten_seconds, fps=2.5)))
    assert len(units) == 25
    for number, unit in enumerate(units):
        assert unit.timestamp == pytest.approx(number * 0.4, abs=0.051)
        assert _frame_number(unit.image) == round(unit.timestamp * 10)


def test_num_frames_uniform(ten_seconds: Path) -> None:
    units = _images(list(sample_video_frames(ten_seconds, num_frames=4)))
    assert len(units) == 4
    for unit, target in zip(units, [1.25, 3.75, 6.25, 8.75], strict=True):
        assert unit.timestamp == pytest.approx(target, abs=0.051)
        assert _frame_number(unit.image) == round(unit.timestamp * 10)


def test_max_frames_cap_spreads_over_the_whole_video(ten_seconds: Path) -> None:
    units = _images(list(sample_video_frames(ten_seconds, fps=10.0, max_frames=5)))
    assert [u.timestamp for u in units] == pytest.approx([0.0, 2.0, 4.0, 6.0, 8.0], abs=1e-6)
    assert [_frame_number(u.image) for u in units] == [0, 20, 40, 60, 80]


def test_one_frame_is_produced_once(tmp_path: Path) -> None:
    path = _write(tmp_path / "short.mp4", seconds=1)
    units = _images(list(sample_video_frames(path, num_frames=30)))
    assert len(units) == 10  # 30 times, 10 frames: no duplicates
    times = [u.timestamp for u in units]
    assert times == sorted(set(times))
    assert [u.index for u in units] == list(range(10))


def test_variable_frame_rate_hold_is_not_a_failure(tmp_path: Path) -> None:
    # Frames every 0.1 s up to 3.0 s, then nothing new until 8.0 s (a paused screen recording).
    pts = list(range(31)) + list(range(80, 90))
    path = tmp_path / "vfr.mp4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(CODEC, rate=10)
        stream.width, stream.height = WIDTH, HEIGHT
        stream.pix_fmt = "yuv420p"
        encoded = []
        for number in pts:
            frame = av.VideoFrame.from_ndarray(_frame_array(number), format="rgb24").reformat(
                format="yuv420p"
            )
            frame.pts = number
            encoded.append(frame)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    units = _images(list(sample_video_frames(path, fps=1.0, max_frames=64)))
    assert [_frame_number(u.image) for u in units] == [0, 10, 20, 30, 80]


# -- seeking -------------------------------------------------------------------------------


def _count_seeks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    seeks: list[float] = []
    real = video._Cursor._seek

    def counting(self: video._Cursor, target: float, position: float, **kwargs: bool) -> None:
        seeks.append(target)
        real(self, target, position, **kwargs)

    monkeypatch.setattr(video._Cursor, "_seek", counting)
    return seeks


def test_seek_path_gives_the_same_frames_as_decoding_through(
    twenty_seconds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeks = _count_seeks(monkeypatch)
    monkeypatch.setattr(video, "SEEK_GAP_SECONDS", 1e9)
    sequential = _images(list(sample_video_frames(twenty_seconds, num_frames=6)))
    assert seeks == []

    monkeypatch.setattr(video, "SEEK_GAP_SECONDS", 0.5)
    seeking = _images(list(sample_video_frames(twenty_seconds, num_frames=6)))
    assert len(seeks) >= 5

    assert [u.timestamp for u in seeking] == [u.timestamp for u in sequential]
    assert [_frame_number(u.image) for u in seeking] == [_frame_number(u.image) for u in sequential]
    for a, b in zip(seeking, sequential, strict=True):
        diff = np.abs(np.asarray(a.image, np.int16) - np.asarray(b.image, np.int16))
        assert diff.mean() < 1.0


def test_default_gap_seeks_only_for_sparse_targets(
    twenty_seconds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeks = _count_seeks(monkeypatch)
    list(sample_video_frames(twenty_seconds, fps=1.0))
    assert seeks == []  # 1 s apart: decoding through is cheaper
    units = _images(list(sample_video_frames(twenty_seconds, num_frames=4)))
    assert seeks  # 5 s apart: seek
    assert [_frame_number(u.image) for u in units] == [25, 75, 125, 175]


def _count_decoded(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The time of every frame that came out of the decoder (skipped frames never do)."""
    decoded: list[float] = []
    real = video._Decoded

    def counting(time: float, duration: float, frame: av.VideoFrame) -> video._Decoded:
        decoded.append(time)
        return real(time, duration, frame)

    monkeypatch.setattr(video, "_Decoded", counting)
    return decoded


def test_keyframe_spacing_is_read_from_the_index_or_the_first_packets(tmp_path: Path) -> None:
    for name, fmt in (("a.mp4", None), ("b.mkv", None), ("c.h264", "h264")):
        if fmt == "h264" and CODEC != "libx264":
            continue
        path = _write(tmp_path / name, seconds=12, fmt=fmt, gop=30)  # a keyframe every 3 s
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            spacing = video.keyframe_interval(container, stream, path, 12.0)
            # A raw stream has no timestamps nor frame rate: 30 packets at the guessed rate.
            expected = 3.0 if fmt is None else 30 * video._frame_interval(stream)
        assert spacing == pytest.approx(expected, rel=0.12), name
    single = _write(tmp_path / "one.mp4", seconds=6, gop=1000)
    with av.open(str(single)) as container:
        assert video.keyframe_interval(container, container.streams.video[0], single, 6.0) >= 5.5


def test_the_seek_gap_follows_the_keyframe_spacing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "gop4.mp4", seconds=24, gop=40)  # a keyframe every 4 s
    seeks = _count_seeks(monkeypatch)
    units = _images(list(sample_video_frames(path, num_frames=8)))  # 3 s apart: decode through
    assert seeks == []
    assert [_frame_number(u.image) for u in units] == [15 + 30 * i for i in range(8)]
    units = _images(list(sample_video_frames(path, num_frames=3)))  # 8 s apart: seek
    assert len(seeks) >= 2
    assert [_frame_number(u.image) for u in units] == [40, 120, 200]


@pytest.mark.skipif(CODEC != "libx264", reason="needs B-frames (libx264)")
def test_frames_no_sample_can_pick_are_not_decoded_and_the_result_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "gop8.mp4", seconds=16, gop=80)  # B-frames, a keyframe every 8 s
    decoded = _count_decoded(monkeypatch)
    skipping = list(sample_video_frames(path, fps=1.0))
    skipped_count = len(decoded)
    decoded.clear()
    monkeypatch.setattr(video, "RECENT_PACKETS", 0)  # never sure a frame is not needed: decode all
    full = list(sample_video_frames(path, fps=1.0))
    assert len(decoded) >= 150  # every frame of the video
    assert skipped_count < 0.8 * len(decoded)  # x264's non-reference B-frames were left out
    assert [(u.index, u.timestamp, u.image.tobytes()) for u in _images(skipping)] == [
        (u.index, u.timestamp, u.image.tobytes()) for u in _images(full)
    ]
    assert [_frame_number(u.image) for u in _images(skipping)] == list(range(0, 160, 10))


def test_keyframes_snap_sparse_samples_and_record_the_decoded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "gop2.mp4", seconds=30, gop=20)  # keyframes at 0, 2, 4 ... s
    decoded = _count_decoded(monkeypatch)
    units = _images(list(sample_video_frames(path, num_frames=6, keyframes=True)))
    # Asked 2.5, 7.5, 12.5 ...: the nearest keyframes are 2, 8, 12, 18, 22, 28 s.
    assert [u.timestamp for u in units] == pytest.approx([2.0, 8.0, 12.0, 18.0, 22.0, 28.0], abs=1e-6)
    assert [_frame_number(u.image) for u in units] == [20, 80, 120, 180, 220, 280 % 256]
    assert len(decoded) <= 6 + 3  # one keyframe per sample (and the first frames, to open the video)
    exact = _images(list(sample_video_frames(path, num_frames=6)))
    assert [_frame_number(u.image) for u in exact] == [25, 75, 125, 175, 225, 275 % 256]


def test_keyframes_cost_the_same_on_a_long_video(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = _write(tmp_path / "short.mp4", seconds=40, gop=40)  # a keyframe every 4 s
    long = _write(tmp_path / "long.mp4", seconds=160, gop=40)
    decoded = _count_decoded(monkeypatch)
    counts = []
    for path in (short, long):
        decoded.clear()
        assert len(_images(list(sample_video_frames(path, num_frames=8, keyframes=True)))) == 8
        counts.append(len(decoded))
    assert counts[1] <= counts[0] <= 8 + 3  # one keyframe a sample, whatever the length
    decoded.clear()
    list(sample_video_frames(long, num_frames=8))
    assert len(decoded) > counts[1] + 8  # exact times decode on from the keyframe before each


def test_keyframes_leave_dense_samples_exact(tmp_path: Path) -> None:
    path = _write(tmp_path / "gop2.mp4", seconds=10, gop=20)
    snapped = _images(list(sample_video_frames(path, fps=1.0, keyframes=True)))  # 1 s apart, keyframes 2 s
    assert [_frame_number(u.image) for u in snapped] == list(range(0, 100, 10))


def test_keyframes_never_collapse_samples_onto_one_keyframe(tmp_path: Path) -> None:
    path = _write(tmp_path / "rare.mp4", seconds=12, gop=60)  # keyframes at 0 and 6 s only
    units = _images(list(sample_video_frames(path, num_frames=12, fps=None, keyframes=True)))
    assert len(units) == 12  # 1 s apart, keyframes 6 s apart: not sparse, every sample exact
    units = _images(list(sample_video_frames(path, num_frames=2, keyframes=True)))
    assert [_frame_number(u.image) for u in units] == [0, 60]  # 3 s and 9 s asked: 0 s and 6 s are nearest
    # 2, 6 and 10 s asked, 4 s apart: denser than the keyframes, so exact times
    units = _images(list(sample_video_frames(path, num_frames=3, keyframes=True)))
    assert [_frame_number(u.image) for u in units] == [20, 60, 100]


@pytest.mark.parametrize("keyframes", [False, True])
def test_a_stream_without_timestamps_is_decoded_through_for_sparse_times(
    tmp_path: Path, keyframes: bool
) -> None:
    """A failed seek on a raw .h264 once read it to the end: every later time was "past the end"."""
    if CODEC != "libx264":
        pytest.skip("needs libx264")
    path = _write(tmp_path / "raw.h264", seconds=8, fmt="h264", gop=20)
    units = _images(list(sample_video_frames(path, num_frames=2, keyframes=keyframes)))
    assert [_frame_number(u.image) for u in units] == [20, 60]


def test_frames_are_freed_as_they_go_not_left_to_the_cycle_collector(tmp_path: Path) -> None:
    """Reading a frame's side data makes a reference cycle: per frame, RSS grew ~70 MB per 600
    frames until the collector ran (bench/ingest_memory.py). Only the first frame's is read."""
    path = _write(tmp_path / "ten.mp4", seconds=10)
    alive = []
    for fps in (2.0, 10.0):
        gc.collect()
        gc.disable()
        try:
            for _unit in sample_video_frames(path, fps=fps):
                pass
            alive.append(sum(type(o) is av.VideoFrame for o in gc.get_objects()))
        finally:
            gc.enable()
    assert max(alive) <= 8, alive  # a few, whether 20 frames or 100 (it was 22 and 67)


# -- rotation ------------------------------------------------------------------------------


def _strip_frames() -> list[np.ndarray]:
    array = np.zeros((32, 64, 3), np.uint8)
    array[:, :16] = 255  # a white strip down the left side of the stored picture
    return [array] * 5


@pytest.mark.parametrize(
    ("degrees", "hflip", "size", "white_at"),
    [
        (90, False, (32, 64), (16, 60)),  # turned counter-clockwise: the left strip is at the bottom
        (-90, False, (32, 64), (16, 3)),  # turned clockwise: at the top
        (180, False, (64, 32), (60, 16)),  # upside down: at the right
        (0, True, (64, 32), (60, 16)),  # mirrored: at the right
        (0, False, (64, 32), (3, 16)),
    ],
)
def test_display_matrix_is_applied(
    tmp_path: Path, degrees: float, hflip: bool, size: tuple[int, int], white_at: tuple[int, int]
) -> None:
    path = _write(tmp_path / "phone.mp4", fps=5, arrays=_strip_frames(), rotation=(degrees, hflip))
    (unit,) = _images(list(sample_video_frames(path, num_frames=1)))
    assert unit.image.size == size
    assert unit.image.getpixel(white_at)[0] > 200
    # the opposite side stays black
    far = (size[0] - 1 - white_at[0], size[1] - 1 - white_at[1])
    assert unit.image.getpixel(far)[0] < 50


# -- other containers ----------------------------------------------------------------------


def test_raw_h264_without_timestamps(tmp_path: Path) -> None:
    if CODEC != "libx264":
        pytest.skip("needs libx264")
    path = _write(tmp_path / "raw.h264", seconds=5, fmt="h264")
    units = _images(list(sample_video_frames(path, fps=1.0)))
    assert len(units) == 5
    assert [_frame_number(u.image) for u in units] == [0, 10, 20, 30, 40]


def test_matroska(tmp_path: Path) -> None:
    path = _write(tmp_path / "clip.mkv", seconds=3)
    units = _images(list(sample_video_frames(path, fps=1.0)))
    assert [_frame_number(u.image) for u in units] == [0, 10, 20]


# -- broken or wrong files -----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_truncated_mp4_without_index(tmp_path: Path) -> None:
    data = _write(tmp_path / "full.mp4", seconds=4).read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceError, match="truncated or corrupt"):
        list(sample_video_frames(path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_truncated_mp4_with_index_first_decodes_what_is_there(tmp_path: Path, fraction: float) -> None:
    full = _write(tmp_path / "full.mp4", seconds=10, container_options={"movflags": "faststart"})
    data = full.read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: int(len(data) * fraction)])
    units = list(sample_video_frames(path, fps=1.0))
    images = [u for u in units if isinstance(u, RenderedImage)]
    failures = [u for u in units if isinstance(u, UnitFailure)]
    assert images, "the frames before the cut decode"
    assert failures, "the times after the cut are reported"
    assert all("truncated" in f.message for f in failures)
    assert [u.index for u in units] == list(range(len(units)))
    assert max(u.timestamp or 0 for u in images) < min(f.timestamp or 0 for f in failures)


def test_audio_only(tmp_path: Path) -> None:
    path = tmp_path / "talk.m4a"
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=44100)
        stream.layout = "mono"
        for i in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 44100
            frame.pts = i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(SourceError, match=r"audio only"):
        list(sample_video_frames(path))


def test_not_a_video(tmp_path: Path) -> None:
    path = tmp_path / "x.mp4"
    path.write_text("definitely not a video")
    with pytest.raises(SourceError, match="cannot open video"):
        list(sample_video_frames(path))
