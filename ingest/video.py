"""Sample upright RGB frames from a video at chosen times, with PyAV.

Which times:
  * ``num_frames=N``: the centres of N equal segments of the duration, (i + 0.5) * D / N.
  * else every ``1/fps`` seconds from 0 while < D. When that is more than ``max_frames``
    times, ``max_frames`` times are spread evenly over the *whole* video instead
    (i * D / max_frames): a cap that cut at the beginning would silently drop the end of
    every long video, which is usually what the user wants summarised.

For each time we take the decoded frame nearest to it; when two times land on the same
frame (a short video, a slide show), that frame is produced once. Ordinals in ``index``
count the units produced, failures included.

Sparse times are reached by seeking to the keyframe before them and decoding forward;
dense times by decoding straight through, which is cheaper than a seek per GOP.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
from PIL import Image

from ingest.detect import describe_av_error, is_cover_art, is_still_image_format
from ingest.units import RenderedImage, SourceError, UnitFailure

DEFAULT_FPS = 1.0
# Seek when the next time is further than this past the last decoded frame. Typical GOPs
# are 0.5-2 s (250 frames at most for x264 defaults), so decoding through a gap this size
# costs about what a seek (which restarts at a keyframe) costs.
SEEK_GAP_SECONDS = 2.0
# A frame further than this before a target means the data ran out (a truncated file).
MIN_END_TOLERANCE_SECONDS = 0.5
# Seeks that land where decoding already was before seeking is given up (no index).
MAX_USELESS_SEEKS = 3
# Broken packets are skipped, but a file that is mostly garbage should end, not grind on.
MAX_DECODE_ERRORS = 100
_AV_ERRORS = (av.FFmpegError, OSError, EOFError, ValueError, MemoryError)


def plan_targets(
    duration: float, *, fps: float | None = DEFAULT_FPS, max_frames: int = 64, num_frames: int | None = None
) -> list[float]:
    """Times (seconds from the start) at which to sample a video of ``duration`` seconds."""
    duration = max(duration, 0.0)
    if num_frames is not None:
        return [duration * (i + 0.5) / num_frames for i in range(num_frames)]
    fps = fps or DEFAULT_FPS
    # i / fps < duration; the epsilon keeps an exact 6.0 s at 1 fps from giving 7 times.
    count = max(1, math.ceil(duration * fps - 1e-9))
    if count <= max_frames:
        return [i / fps for i in range(count)]
    return [i * duration / max_frames for i in range(max_frames)]


def sample_video_frames(
    path: Path,
    *,
    fps: float | None = DEFAULT_FPS,
    max_frames: int = 64,
    num_frames: int | None = None,
    max_seconds: float | None = None,
) -> Iterator[RenderedImage | UnitFailure]:
    """Yield frames sampled from the video at ``path`` (see the module docstring for which).

    Raises SourceError (on the first ``next()``) when the file cannot be opened, has no
    video stream, or has no decodable frame. A truncated file yields what decodes, then a
    UnitFailure for each time past the end of the data.
    """
    path = Path(path)
    container = _open(path)
    try:
        stream = _video_stream(container)
        duration = _header_duration(container, stream)
        if duration is None:
            duration = _duration_by_demux(path)
        if max_seconds is not None and duration > max_seconds:
            raise SourceError(
                f"video lasts {duration:.0f} s, over the limit of {max_seconds:.0f} s "
                "(raise VISBATCH_LIMIT_MAX_VIDEO_SECONDS)"
            )
        cursor = _Cursor(container, stream)
        if cursor.nearest(0.0) is None:
            raise SourceError("video has no decodable frames")
        targets = plan_targets(duration, fps=fps, max_frames=max_frames, num_frames=num_frames)
        yield from _sample(cursor, targets, stream)
    finally:
        container.close()


def _open(path: Path) -> av.container.InputContainer:
    try:
        return av.open(str(path), mode="r")
    except FileNotFoundError as exc:
        raise SourceError("file not found") from exc
    except Exception as exc:
        raise SourceError(f"cannot open video (truncated or corrupt?): {describe_av_error(exc)}") from exc


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if is_still_image_format(container.format.name):
        raise SourceError("not a video (a single picture, or not media at all)")
    streams = [s for s in container.streams.video if not is_cover_art(s)]
    if not streams:
        if container.streams.audio:
            raise SourceError("media file has no video stream (audio only)")
        raise SourceError("media file has no video stream")
    stream = streams[0]
    if stream.codec_context is None:
        raise SourceError(f"no decoder for the video codec ({stream.codec.name if stream.codec else '?'})")
    stream.thread_type = "AUTO"  # frame + slice threads: several times faster on HD video
    return stream


def _header_duration(container: av.container.InputContainer, stream: av.VideoStream) -> float | None:
    """Seconds of video as the headers state it, or None when they do not."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration and container.duration > 0:
        return container.duration / av.time_base
    return None


def _duration_by_demux(path: Path) -> float:
    """Seconds of video found by reading every packet (demuxing only: no decoding, cheap).

    For streamed formats whose headers carry no duration (raw H.264, some WebM/MPEG-TS).
    A second container, so the one that decodes stays at the start.
    """
    container = _open(path)
    try:
        return _demux_duration(container, _video_stream(container))
    finally:
        container.close()


def _demux_duration(container: av.container.InputContainer, stream: av.VideoStream) -> float:
    time_base = stream.time_base or Fraction(1, av.time_base)
    start = stream.start_time
    end = None
    summed = 0  # raw streams (.h264) have no timestamps at all, only packet durations
    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the flush packet PyAV adds at the end
            count += 1
            summed += packet.duration or 0
            if packet.pts is None:
                continue
            if start is None or packet.pts < start:
                start = packet.pts
            last = packet.pts + (packet.duration or 0)
            end = last if end is None else max(end, last)
    except _AV_ERRORS:
        pass  # a damaged tail: the duration is what could be read
    if end is not None and start is not None:
        return float((end - start) * time_base)
    if summed:
        return float(summed * time_base)
    return count * _frame_interval(stream)


def _frame_interval(stream: av.VideoStream) -> float:
    rate = stream.average_rate or stream.guessed_rate
    return float(1 / rate) if rate else 1 / 30


@dataclass(frozen=True)
class _Decoded:
    time: float  # seconds from the stream's start
    duration: float  # seconds the frame is shown (0 when the file does not say)
    frame: av.VideoFrame


class _Cursor:
    """Walks the decoded frames of one stream forward, seeking over large gaps."""

    def __init__(self, container: av.container.InputContainer, stream: av.VideoStream) -> None:
        self._container = container
        self._stream = stream
        self._time_base = stream.time_base or Fraction(1, av.time_base)
        self._start = stream.start_time or 0
        self.frame_interval = _frame_interval(stream)
        self.furthest: float | None = None  # the latest time decoded so far, for messages
        self._frames: Iterator[_Decoded] | None = None
        self._before: _Decoded | None = None  # the frame decoded just before _last
        self._last: _Decoded | None = None  # the most recent frame out of the decoder
        self.at_end = False  # the decoder ran out of data (since the last seek)
        self._can_seek = True
        self._useless_seeks = 0
        self._errors = 0

    def nearest(self, target: float) -> _Decoded | None:
        """The frame nearest to ``target`` seconds, among those not before the previous answer.

        None only when no frame at all could be decoded from where we are.
        """
        position = self._last.time if self._last is not None else 0.0
        if self._frames is None:
            self._frames = self._decode()
        if self._can_seek and target - position > SEEK_GAP_SECONDS:
            self._seek(target, position)
        while self._last is None or self._last.time < target:
            decoded = next(self._frames, None)
            if decoded is None:
                self.at_end = True
                return self._last  # the end of the data: the last frame is the nearest left
            self._before, self._last = self._last, decoded
        if self._before is not None and target - self._before.time < self._last.time - target:
            return self._before
        return self._last

    def _seek(self, target: float, position: float) -> None:
        offset = self._start + int(Fraction(target) / self._time_base)
        try:
            self._container.seek(offset, stream=self._stream, backward=True, any_frame=False)
        except _AV_ERRORS:
            self._can_seek = False  # unseekable input: decoding straight through still works
            return
        if self._frames is not None:
            self._frames.close()
        self._frames = self._decode()
        self._before = self._last = None
        self.at_end = False
        first = next(self._frames, None)
        if first is None:
            self.at_end = True
            return
        self._last = first
        if first.time <= position:
            # The seek went back to where we already were: a GOP longer than the gap (once in
            # a while, harmless) or a file without an index, where every seek lands at the
            # start and seeking would make sampling quadratic. Stop after a few such.
            self._useless_seeks += 1
            if self._useless_seeks >= MAX_USELESS_SEEKS:
                self._can_seek = False

    def _decode(self) -> Iterator[_Decoded]:
        previous: float | None = None
        try:
            for packet in self._container.demux(self._stream):
                try:
                    frames = packet.decode()
                except _AV_ERRORS:
                    # One corrupt packet costs the frames up to the next keyframe, not the video.
                    self._errors += 1
                    if self._errors > MAX_DECODE_ERRORS:
                        return
                    continue
                for frame in frames:
                    previous = self._time(frame, previous)
                    if self.furthest is None or previous > self.furthest:
                        self.furthest = previous
                    yield _Decoded(previous, self._duration(frame), frame)
        except _AV_ERRORS:
            return  # demuxing failed (truncated or damaged container): the data ends here

    def _duration(self, frame: av.VideoFrame) -> float:
        if not frame.duration:
            return 0.0
        return float(frame.duration * (frame.time_base or self._time_base))

    def _time(self, frame: av.VideoFrame, previous: float | None) -> float:
        pts = frame.pts if frame.pts is not None else frame.dts
        if pts is None:
            # No timestamp at all (raw .h264 and the like): add up the frame durations.
            if previous is None:
                return 0.0
            return previous + (self._duration(frame) or self.frame_interval)
        return float((pts - self._start) * self._time_base)


def _sample(
    cursor: _Cursor, targets: list[float], stream: av.VideoStream
) -> Iterator[RenderedImage | UnitFailure]:
    tolerance = max(MIN_END_TOLERANCE_SECONDS, 3 * cursor.frame_interval)
    rotate_tag = stream.metadata.get("rotate")
    index = 0
    produced: _Decoded | None = None
    for target in targets:
        found = cursor.nearest(target)
        # Only running out of data is a failure: a frame long before the target that is
        # followed by later frames is simply still on screen (variable frame rate).
        if found is None or (cursor.at_end and target - (found.time + found.duration) > tolerance):
            yield UnitFailure(index, _past_the_end(target, cursor.furthest), target)
            index += 1
            continue
        if produced is not None and found.time <= produced.time:
            continue  # two targets, one frame: produce it once (and never step back in time)
        produced = found
        try:
            image = upright_image(found.frame, rotate_tag)
        except Exception as exc:
            yield UnitFailure(index, f"frame at {found.time:.2f} s could not be converted: {exc}", found.time)
        else:
            yield RenderedImage(index=index, image=image, timestamp=max(found.time, 0.0))
        index += 1


def _past_the_end(target: float, furthest: float | None) -> str:
    end = f"the video data ends at {furthest:.2f} s" if furthest is not None else "no data there"
    return f"no frame near {target:.2f} s ({end}: truncated or damaged file, or shorter than its header says)"


def upright_image(frame: av.VideoFrame, rotate_tag: str | None = None) -> Image.Image:
    """The frame as an RGB image, turned the way the display matrix says it is shown.

    FFmpeg 7+ (PyAV >= 13) attaches the stream's display matrix to every decoded frame as
    DISPLAYMATRIX side data; ``frame.rotation`` is its counter-clockwise angle. The legacy
    ``rotate`` metadata tag (clockwise degrees) is a fallback for other builds.
    """
    image = frame.to_image()
    if image.mode != "RGB":
        image = image.convert("RGB")
    matrix = _display_matrix(frame)
    if matrix is not None:
        return _apply_display_matrix(image, -float(frame.rotation), matrix)
    if rotate_tag:
        try:
            return _apply_display_matrix(image, float(rotate_tag), None)
        except ValueError:
            return image
    return image


def _display_matrix(frame: av.VideoFrame) -> tuple[int, ...] | None:
    try:
        side = frame.side_data.get(av.sidedata.sidedata.Type.DISPLAYMATRIX)
    except (AttributeError, KeyError):
        return None
    if side is None:
        return None
    data = bytes(side)
    if len(data) < 36:
        return None
    return struct.unpack("=9i", data[:36])


def _apply_display_matrix(
    image: Image.Image, clockwise: float, matrix: tuple[int, ...] | None
) -> Image.Image:
    """Do what ffmpeg's autorotate does (fftools/ffmpeg_filter.c), flips included."""
    theta = float(round(clockwise))  # FFmpeg rounds the angle first, then folds it into [0, 360)
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    m = matrix or (65536, 0, 0, 0, 65536, 0, 0, 0, 1 << 30)
    if abs(theta - 90) < 1.0:
        return image.transpose(Image.Transpose.TRANSPOSE if m[3] > 0 else Image.Transpose.ROTATE_270)
    if abs(theta - 180) < 1.0:
        if matrix is None:
            return image.transpose(Image.Transpose.ROTATE_180)
        if m[0] < 0:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if m[4] < 0:
            image = image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
        return image
    if abs(theta - 270) < 1.0:
        return image.transpose(Image.Transpose.TRANSVERSE if m[3] < 0 else Image.Transpose.ROTATE_90)
    if abs(theta) > 1.0:
        return image.rotate(-theta, expand=True)  # PIL turns counter-clockwise
    if m[4] < 0:
        return image.transpose(Image.Transpose.FLIP_TOP_BOTTOM)
    return image
