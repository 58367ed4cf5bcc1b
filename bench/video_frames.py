"""Q2. Video to sampled frames: visbatch (PyAV, seeking over gaps) against ffmpeg's fps filter.

Both sides deliver the same thing: decoded RGB frames in memory (visbatch: PIL images from
`sample_video_frames`; ffmpeg: `-vf fps=F -f rawvideo -pix_fmt rgb24` read from its stdout).
visbatch runs in-process (an ingest worker is a long-lived process); ffmpeg is the subprocess
a user would spawn, its start included. Videos: H.264 640x360, 25 fps, a keyframe every 2 s,
B-frames (x264 superfast), generated once into bench/.cache.

  * 1 fps: every second of a 60 s video (and of a 10-minute one in full mode);
  * 32 frames spread over a long video (10 min; 2 min in quick mode): visbatch seeks to the
    keyframe before each time, the fps filter decodes everything. For reference, 32 separate
    `ffmpeg -ss T -frames:v 1` runs (input seeking, one process per frame) are timed too;
  * flatness: visbatch's time for 32 frames over a 10 s video and over the long one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.common import (
    Check,
    arguments,
    bars,
    interleaved,
    median,
    paired_ratio,
    rounded,
    tool,
    write_result,
)
from bench.media import video
from ingest.units import RenderedImage
from ingest.video import sample_video_frames

SIZE = (640, 360)


def visbatch_frames(path: Path, **options) -> int:
    frames = [f for f in sample_video_frames(path, **options) if isinstance(f, RenderedImage)]
    return len(frames)


def ffmpeg_fps(path: Path, fps: str) -> int:
    done = subprocess.run(
        [
            "ffmpeg",
            "-nostdin",
            "-v",
            "error",
            "-i",
            str(path),
            "-vf",
            f"fps={fps}",
            "-f",
            "rawvideo",
            "-pix_fmt",
            "rgb24",
            "-",
        ],
        capture_output=True,
        check=True,
    )
    return len(done.stdout) // (SIZE[0] * SIZE[1] * 3)


def ffmpeg_seeks(path: Path, times: list[float]) -> int:
    got = 0
    for t in times:
        done = subprocess.run(
            [
                "ffmpeg",
                "-nostdin",
                "-v",
                "error",
                "-ss",
                f"{t:.3f}",
                "-i",
                str(path),
                "-frames:v",
                "1",
                "-f",
                "rawvideo",
                "-pix_fmt",
                "rgb24",
                "-",
            ],
            capture_output=True,
            check=True,
        )
        got += len(done.stdout) // (SIZE[0] * SIZE[1] * 3)
    return got


def counted(fn):
    """Wrap an arm: run it, remember how many frames it gave (checked equal across arms)."""
    counts: list[int] = []

    def go(_rep: int) -> None:
        counts.append(fn())

    go.counts = counts  # type: ignore[attr-defined]
    return go


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=3)
    long_s = 120 if args.quick else 600
    short, minute, long = video(10, SIZE), video(60, SIZE), video(long_s, SIZE)
    have_ffmpeg = tool("ffmpeg") is not None
    notes = [] if have_ffmpeg else ["ffmpeg is not installed (apt-get install ffmpeg): baselines skipped"]
    figures: dict = {"video": f"H.264 {SIZE[0]}x{SIZE[1]} 25 fps, keyframe every 2 s", "long_video_s": long_s}
    checks: list[Check] = []

    # 1 fps over whole videos.
    fps_cases = [(60, minute)] + ([] if args.quick else [(long_s, long)])
    for seconds, path in fps_cases:
        arms = {"visbatch": counted(lambda p=path: visbatch_frames(p, fps=1.0, max_frames=100_000))}
        if have_ffmpeg:
            arms["ffmpeg fps=1"] = counted(lambda p=path: ffmpeg_fps(p, "1"))
        times = interleaved(arms, args.reps)
        entry = {
            "seconds": times.rounded()["wall_s"],
            "cpu_seconds": times.rounded()["cpu_s"],
            "frames": {k: a.counts[0] for k, a in arms.items()},
        }
        if have_ffmpeg:
            entry["speedup"] = rounded(paired_ratio(times["ffmpeg fps=1"], times["visbatch"]))
            checks.append(
                Check(f"1 fps over a {seconds} s video, speed vs ffmpeg fps=1", entry["speedup"], ">=", 1.0)
            )
        figures[f"fps1_{seconds}s"] = entry

    # 32 frames spread over the long video; the same over 10 s for flatness.
    step = long_s / 32
    times_32 = [(i + 0.5) * step for i in range(32)]
    arms = {
        "visbatch 32 frames, 10 s video": counted(lambda: visbatch_frames(short, num_frames=32)),
        f"visbatch 32 frames, {long_s} s video": counted(lambda: visbatch_frames(long, num_frames=32)),
    }
    if have_ffmpeg:
        arms[f"ffmpeg fps=32/{long_s}"] = counted(lambda: ffmpeg_fps(long, f"32/{long_s}"))
        arms["ffmpeg -ss x32"] = counted(lambda: ffmpeg_seeks(long, times_32))
    times = interleaved(arms, args.reps)
    ours_long = times[f"visbatch 32 frames, {long_s} s video"]
    entry = {
        "seconds": times.rounded()["wall_s"],
        "cpu_seconds": times.rounded()["cpu_s"],
        "frames": {k: a.counts[0] for k, a in arms.items()},
    }
    flat = paired_ratio(ours_long, times["visbatch 32 frames, 10 s video"])
    entry["long_over_10s"] = rounded(flat)
    if have_ffmpeg:
        entry["speedup_vs_fps_filter"] = rounded(paired_ratio(times[f"ffmpeg fps=32/{long_s}"], ours_long))
        entry["speedup_vs_ffmpeg_ss"] = rounded(paired_ratio(times["ffmpeg -ss x32"], ours_long))
        checks.append(
            Check(
                f"32 frames over {long_s} s, speed vs ffmpeg fps filter",
                entry["speedup_vs_fps_filter"],
                ">=",
                5.0,
            )
        )
    checks.append(
        Check(
            f"32 frames: time over a {long_s} s video / over a 10 s video ({long_s // 10}x longer)",
            entry["long_over_10s"],
            "<=",
            2.0,
            note="'nearly flat' read as: at most 2x the time for a video that is 10 to 60x longer",
        )
    )
    figures["frames32"] = entry

    chart = {f"32 frames: {k}": median(v) for k, v in times.items()}
    if have_ffmpeg:
        one = figures["fps1_60s"]["seconds"]
        chart = {
            "1 fps, 60 s: visbatch": median(one["visbatch"]),
            "1 fps, 60 s: ffmpeg": median(one["ffmpeg fps=1"]),
            **chart,
        }
    write_result(
        "video_frames",
        quick=args.quick,
        question="Video to sampled frames",
        baseline="ffmpeg -vf fps=... to raw RGB frames (process start included)",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            list(chart), [rounded(v) for v in chart.values()], "seconds (lower is better)", "Q2 video frames"
        ),
        notes=notes,
    )


if __name__ == "__main__":
    main()
