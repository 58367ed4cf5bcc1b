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

How, per video, from the sampling density and the keyframe spacing (read from the container's
index, or from the first packets): a time further than one keyframe interval (and at least
``SEEK_GAP_SECONDS``) past the last decoded frame is reached by seeking to the keyframe before
it and decoding forward; closer times by decoding straight through, which is cheaper than a
seek per GOP (a 720p video with a keyframe every 8 s, sampled at 1 fps, decodes through).
Either way, a frame that no sample can pick (another frame lies between it and the next
time) is not decoded when nothing references it (FFmpeg's ``skip_frame=NONREF``: about half
the frames of an x264 video with B-frames), so the frames produced are exactly those of a
full decode.

With ``keyframes=True`` sparse samples (further apart than the keyframe spacing) snap to the
nearest keyframe, when one lies within half the distance to the neighbouring samples: a seek
and one keyframe decoded per sample, whatever the video's length. The timestamp recorded is
the decoded keyframe's, never the time asked for.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
from PIL import Image

from ingest.detect import describe_av_error, is_cover_art, is_still_image_format
from ingest.units import RenderedImage, SourceError, UnitFailure

DEFAULT_FPS = 1.0
# Seek only when the next time is further than this (and than the keyframe spacing) past the
# last decoded frame: below it decoding through costs about what a seek (which restarts the
# decoder at a keyframe) costs.
SEEK_GAP_SECONDS = 2.0
# Keyframe spacing: measured at this many places of the container's index, or, without an
# index, over at most this many packets from the start (demuxed, not decoded).
INDEX_PROBES = 16
PROBE_PACKETS = 3000
PROBE_KEYFRAMES = 6
# How many recent packet timestamps decide whether a frame can be left undecoded (more than
# any decoder's reordering delay).
RECENT_PACKETS = 32
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
    keyframes: bool = False,
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
        interval = keyframe_interval(container, stream, path, duration)
        cursor.seek_gap = max(SEEK_GAP_SECONDS, interval)
        snap = keyframes and len(targets) > 1 and _typical_gap(targets) >= interval
        yield from _sample(cursor, targets, stream, snap=snap)
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


def keyframe_interval(
    container: av.container.InputContainer, stream: av.VideoStream, path: Path, duration: float
) -> float:
    """Typical seconds from one keyframe to the next: what a seek costs in frames to decode.

    From the container's index where it has one (MP4, MOV, AVI; Matroska once its cues are
    read), measured around INDEX_PROBES evenly spread times: a time falls in a long GOP more
    often than in a short one, which is how seeks fall too. Else from the keyframes among the
    first packets. A video with a single keyframe gets its whole duration.
    """
    spacing = _index_spacing(stream)
    if spacing is None:
        spacing = _probed_spacing(path)
    if spacing is None or spacing <= 0:
        return max(duration, _frame_interval(stream))
    return spacing


def _index_spacing(stream: av.VideoStream) -> float | None:
    entries = stream.index_entries
    if len(entries) < 2:
        return None
    first, last = entries[0].timestamp, entries[len(entries) - 1].timestamp
    spacings = []
    for i in range(INDEX_PROBES):
        probe = first + (last - first) * (i + 0.5) / INDEX_PROBES
        before = entries.search_timestamp(int(probe), backward=True)
        after = entries.search_timestamp(int(probe) + 1, backward=False)
        if before >= 0 and after > before:
            spacings.append(entries[after].timestamp - entries[before].timestamp)
    if not spacings:
        return None  # one keyframe in the index (or an index of a few entries): probe instead
    time_base = stream.time_base or Fraction(1, av.time_base)
    return float(Fraction(sum(spacings), len(spacings)) * time_base)


def _probed_spacing(path: Path) -> float | None:
    """Mean keyframe spacing over the first packets, or the span read when only one keyframe
    turned up (the spacing is at least that). A second container: the decoding one stays put.
    Raw streams (.h264) have no timestamps: there packets are counted, a frame interval each."""
    try:
        container = av.open(str(path), mode="r")
    except Exception:
        return None
    try:
        stream = _video_stream(container)
        time_base = stream.time_base or Fraction(1, av.time_base)
        interval = _frame_interval(stream)
        keys: list[float] = []
        times: list[float] = []
        for count, packet in enumerate(container.demux(stream)):
            if packet.size == 0 or count >= PROBE_PACKETS:
                break
            time = float(packet.pts * time_base) if packet.pts is not None else count * interval
            times.append(time)
            if packet.is_keyframe:
                keys.append(time)
                if len(keys) >= PROBE_KEYFRAMES:
                    break
    except (*_AV_ERRORS, SourceError):
        return None
    finally:
        container.close()
    if len(keys) >= 2:
        return (keys[-1] - keys[0]) / (len(keys) - 1)
    if len(times) >= 2:
        return max(times) - min(times)
    return None


def _typical_gap(targets: list[float]) -> float:
    gaps = sorted(b - a for a, b in zip(targets, targets[1:], strict=False))
    return gaps[len(gaps) // 2]


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
        self._codec = stream.codec_context
        self._time_base = stream.time_base or Fraction(1, av.time_base)
        self._start = stream.start_time or 0
        self.frame_interval = _frame_interval(stream)
        self.seek_gap = SEEK_GAP_SECONDS  # set per video from its keyframe spacing
        self.furthest: float | None = None  # the latest time decoded so far, for messages
        self._frames: Iterator[_Decoded] | None = None
        self._before: _Decoded | None = None  # the frame decoded just before _last
        self._last: _Decoded | None = None  # the most recent frame out of the decoder
        self._target = 0.0  # the time being looked for: frames no sample can pick are skipped
        self._needs_seek = False  # the decoder was drained (a keyframe taken alone): seek first
        self.at_end = False  # the decoder ran out of data (since the last seek)
        self._can_seek = True
        self._useless_seeks = 0
        self._errors = 0

    def nearest(self, target: float) -> _Decoded | None:
        """The frame nearest to ``target`` seconds, among those not before the previous answer.

        None only when no frame at all could be decoded from where we are.
        """
        position = self._last.time if self._last is not None else 0.0
        self._target = target
        if self._needs_seek:
            self._seek(target, position, forced=True)
        elif self._can_seek and target - position > self.seek_gap:
            self._seek(target, position)
        if self._frames is None:
            self._frames = self._decode()
        while self._last is None or self._last.time < target:
            decoded = next(self._frames, None)
            if decoded is None:
                self.at_end = True
                return self._last  # the end of the data: the last frame is the nearest left
            self._before, self._last = self._last, decoded
        if self._before is not None and target - self._before.time < self._last.time - target:
            return self._before
        return self._last

    def keyframe_near(self, target: float, reach: float) -> _Decoded | None:
        """The keyframe nearest to ``target``, decoded alone, if one lies within ``reach`` of it.

        Seeks to the keyframe at or before the target, reads packets (no decoding) up to the next
        keyframe, and decodes the nearer of the two. None (nothing decoded) when neither is
        close enough, or the file cannot seek: the caller then decodes exactly.
        """
        if not self._can_seek or not self._seek_demuxer(target):
            return None
        self._needs_seek = True  # from here on the decoder's state is not a run's: seek again
        best: av.Packet | None = None
        try:
            for packet in self._container.demux(self._stream):
                time = self._packet_time(packet)
                if time is None:
                    if packet.size == 0:
                        break  # the end of the data
                    continue
                if packet.is_keyframe and (
                    best is None or abs(time - target) < abs(self._packet_time(best) - target)
                ):
                    best = packet
                if time > target + (abs(self._packet_time(best) - target) if best is not None else reach):
                    break  # no keyframe further on can be nearer
        except _AV_ERRORS:
            pass
        if best is None or abs(self._packet_time(best) - target) > reach:
            return None
        frames = self._decode_alone(best)
        if not frames:
            return None
        decoded = _Decoded(self._frame_time(frames[0], None), self._duration(frames[0]), frames[0])
        self._before, self._last = None, decoded
        self.furthest = max(self.furthest or decoded.time, decoded.time)
        return decoded

    def _decode_alone(self, packet: av.Packet) -> list[av.VideoFrame]:
        try:
            frames = self._codec.decode(packet)
            frames += self._codec.decode(None)  # drain: frame threads hold the frame back otherwise
        except _AV_ERRORS:
            return []
        return [f for f in frames if isinstance(f, av.VideoFrame)]

    def _seek_demuxer(self, target: float) -> bool:
        offset = self._start + int(Fraction(target) / self._time_base)
        try:
            self._container.seek(offset, stream=self._stream, backward=True, any_frame=False)
        except _AV_ERRORS:
            self._can_seek = False  # unseekable input: decoding straight through still works
            return False
        if self._frames is not None:
            self._frames.close()
            self._frames = None
        self._codec.skip_frame = "DEFAULT"
        return True

    def _seek(self, target: float, position: float, forced: bool = False) -> None:
        self._needs_seek = False
        if not self._seek_demuxer(target):
            if forced:
                raise SourceError("the video stopped being seekable while it was sampled")
            return
        self._frames = self._decode()
        self._before = self._last = None
        self.at_end = False
        first = next(self._frames, None)
        if first is None:
            self.at_end = True
            return
        self._last = first
        if first.time <= position and not forced:
            # The seek went back to where we already were: a GOP longer than the gap (once in
            # a while, harmless) or a file without an index, where every seek lands at the
            # start and seeking would make sampling quadratic. Stop after a few such.
            self._useless_seeks += 1
            if self._useless_seeks >= MAX_USELESS_SEEKS:
                self._can_seek = False

    def _decode(self) -> Iterator[_Decoded]:
        previous: float | None = None
        recent: deque[float] = deque(maxlen=RECENT_PACKETS)
        skipping = False
        try:
            for packet in self._container.demux(self._stream):
                # A frame no sample can pick: before the time looked for, with a later frame that is
                # not after it already read. Left undecoded when no other frame references it.
                time = self._packet_time(packet)
                skip = (
                    time is not None and time < self._target and any(time < t <= self._target for t in recent)
                )
                if skip != skipping:
                    self._codec.skip_frame = "NONREF" if skip else "DEFAULT"
                    skipping = skip
                if time is not None:
                    recent.append(time)
                try:
                    frames = packet.decode()
                except _AV_ERRORS:
                    # One corrupt packet costs the frames up to the next keyframe, not the video.
                    self._errors += 1
                    if self._errors > MAX_DECODE_ERRORS:
                        return
                    continue
                for frame in frames:
                    previous = self._frame_time(frame, previous)
                    if self.furthest is None or previous > self.furthest:
                        self.furthest = previous
                    yield _Decoded(previous, self._duration(frame), frame)
        except _AV_ERRORS:
            return  # demuxing failed (truncated or damaged container): the data ends here
        finally:
            if skipping:
                self._codec.skip_frame = "DEFAULT"

    def _packet_time(self, packet: av.Packet) -> float | None:
        if packet.pts is None:
            return None
        return float((packet.pts - self._start) * self._time_base)

    def _duration(self, frame: av.VideoFrame) -> float:
        if not frame.duration:
            return 0.0
        return float(frame.duration * (frame.time_base or self._time_base))

    def _frame_time(self, frame: av.VideoFrame, previous: float | None) -> float:
        pts = frame.pts if frame.pts is not None else frame.dts
        if pts is None:
            # No timestamp at all (raw .h264 and the like): add up the frame durations. Such a
            # stream cannot seek to a time: FFmpeg's generic seek reads it to the end trying.
            self._can_seek = False
            if previous is None:
                return 0.0
            return previous + (self._duration(frame) or self.frame_interval)
        return float((pts - self._start) * self._time_base)


def _sample(
    cursor: _Cursor, targets: list[float], stream: av.VideoStream, *, snap: bool = False
) -> Iterator[RenderedImage | UnitFailure]:
    tolerance = max(MIN_END_TOLERANCE_SECONDS, 3 * cursor.frame_interval)
    rotate_tag = stream.metadata.get("rotate")
    index = 0
    produced: _Decoded | None = None
    orientation: tuple[float, tuple[int, ...]] | None | object = _UNKNOWN  # read from the first frame
    for number, target in enumerate(targets):
        found = cursor.keyframe_near(target, _reach(targets, number)) if snap else None
        if found is None:
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
        if orientation is _UNKNOWN:
            orientation = display_orientation(found.frame)
        try:
            image = upright_image(found.frame, rotate_tag, orientation)
        except Exception as exc:
            yield UnitFailure(index, f"frame at {found.time:.2f} s could not be converted: {exc}", found.time)
        else:
            yield RenderedImage(index=index, image=image, timestamp=max(found.time, 0.0))
        index += 1


def _reach(targets: list[float], number: int) -> float:
    """How far a sample may move to a keyframe: under half-way to its neighbours, so that
    snapped samples never collapse into one another."""
    gaps = []
    if number > 0:
        gaps.append(targets[number] - targets[number - 1])
    if number + 1 < len(targets):
        gaps.append(targets[number + 1] - targets[number])
    return min(gaps) / 2 if gaps else math.inf


def _past_the_end(target: float, furthest: float | None) -> str:
    end = f"the video data ends at {furthest:.2f} s" if furthest is not None else "no data there"
    return f"no frame near {target:.2f} s ({end}: truncated or damaged file, or shorter than its header says)"


_UNKNOWN = object()


def display_orientation(frame: av.VideoFrame) -> tuple[float, tuple[int, ...]] | None:
    """(clockwise degrees, display matrix) of the frame's stream, or None when it has none.

    Read once per video, from its first frame: every ``frame.side_data`` access makes a
    reference cycle that holds the frame (and FFmpeg's buffers) until the cyclic collector
    runs, which with so few Python objects about is rarely (~70 MB more per 600 frames seen).
    """
    matrix = _display_matrix(frame)
    return None if matrix is None else (-float(frame.rotation), matrix)


def upright_image(
    frame: av.VideoFrame, rotate_tag: str | None = None, orientation: object = _UNKNOWN
) -> Image.Image:
    """The frame as an RGB image, turned the way the display matrix says it is shown.

    FFmpeg 7+ (PyAV >= 13) attaches the stream's display matrix to every decoded frame as
    DISPLAYMATRIX side data; ``frame.rotation`` is its counter-clockwise angle. The legacy
    ``rotate`` metadata tag (clockwise degrees) is a fallback for other builds. ``orientation``
    is ``display_orientation`` of the stream, when already known.
    """
    image = frame.to_image()
    if image.mode != "RGB":
        image = image.convert("RGB")
    if orientation is _UNKNOWN:
        orientation = display_orientation(frame)
    if orientation is not None:
        clockwise, matrix = orientation  # type: ignore[misc]
        return _apply_display_matrix(image, clockwise, matrix)
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
