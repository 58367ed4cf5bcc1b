"""Q2. Video to sampled frames: `visbatch ingest` against ffmpeg's fps filter, whole processes.

Both sides write one lossless PNG file per sampled frame, as a user runs them, start-up
included: `visbatch ingest VIDEO --out DIR ...` (PyAV; manifest too) against
`ffmpeg -i VIDEO -vf fps=F DIR/%05d.png`. ffmpeg's fps filter to raw RGB on a pipe (no image
files at all) is timed beside them as the stricter floor. Videos (bench/media.py, generated
once into bench/.cache): H.264, 25 fps, B-frames (x264 superfast), moving shapes.

  * 1 fps over a 2-minute 720p video with a keyframe every 8 s (2 s of a 360p one in quick
    mode), `--max-frames` high enough to take every sample: both decode the whole video;
  * 32 frames spread over a 10-minute 360p video with a keyframe every 2 s (2 minutes in quick
    mode): `--num-frames 32` against `fps=32/600`; visbatch seeks to the keyframe before each
    time (exact times), or with `--keyframes` takes the nearest keyframe;
  * flatness: `--num-frames 32` over a 10-second video against over the long one, with and
    without `--keyframes`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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

VISBATCH = str(Path(sys.executable).with_name("visbatch"))


def visbatch(path: Path, out: Path, *options: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "VISBATCH_MODEL"}
    argv = [VISBATCH, "ingest", str(path), "--out", str(out), *options]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"visbatch ingest exited {done.returncode}: {done.stderr[-1500:]}")
    return len(list(out.rglob("*.png")))


def ffmpeg_png(path: Path, out: Path, fps: str) -> int:
    out.mkdir()
    argv = ["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-vf", f"fps={fps}", str(out / "%05d.png")]
    subprocess.run(argv, capture_output=True, check=True)
    return len(list(out.glob("*.png")))


def ffmpeg_raw(path: Path, fps: str, size: tuple[int, int]) -> int:
    argv = ["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-vf", f"fps={fps}",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, check=True)
    return len(done.stdout) // (size[0] * size[1] * 3)


class Arm:
    """One timed command; remembers how many frames each run gave (checked equal across runs)."""

    def __init__(self, work: Path, run) -> None:
        self.work, self.run, self.counts = work, run, []

    def __call__(self, _rep: int) -> None:
        out = Path(tempfile.mkdtemp(prefix="out-", dir=self.work))
        try:
            self.counts.append(self.run(out / "o"))
        finally:
            shutil.rmtree(out)


def timed_case(arms: dict[str, Arm], reps: int) -> tuple[dict, object]:
    times = interleaved(arms, reps)
    entry = {
        "seconds": times.rounded()["wall_s"],
        "cpu_seconds": times.rounded()["cpu_s"],
        "frames": {k: a.counts[0] for k, a in arms.items()},
    }
    return entry, times


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=3)
    quick = args.quick
    dense_s, dense_size = (20, (640, 360)) if quick else (120, (1280, 720))
    long_s, size = (120, (640, 360)) if quick else (600, (640, 360))
    dense = video(dense_s, dense_size, gop_seconds=8.0)
    short, long = video(10, size), video(long_s, size)
    have_ffmpeg = tool("ffmpeg") is not None
    notes = (
        []
        if have_ffmpeg
        else ["ffmpeg is not installed (bash bench/install_baselines.sh): baselines skipped"]
    )
    figures: dict = {
        "dense_video": f"H.264 {dense_size[0]}x{dense_size[1]} 25 fps, {dense_s} s, keyframe every 8 s",
        "long_video": f"H.264 {size[0]}x{size[1]} 25 fps, {long_s} s, keyframe every 2 s",
    }
    checks: list[Check] = []
    chart: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-video-") as tmp:
        work = Path(tmp)

        # 1 fps over the whole dense video.
        arms = {"visbatch": Arm(work, lambda o: visbatch(dense, o, "--fps", "1", "--max-frames", "10000"))}
        if have_ffmpeg:
            arms["ffmpeg fps=1 to PNG"] = Arm(work, lambda o: ffmpeg_png(dense, o, "1"))
            arms["ffmpeg fps=1 to raw RGB"] = Arm(work, lambda o: ffmpeg_raw(dense, "1", dense_size))
        entry, times = timed_case(arms, args.reps)
        if have_ffmpeg:
            entry["speedup_vs_png"] = rounded(paired_ratio(times["ffmpeg fps=1 to PNG"], times["visbatch"]))
            entry["speedup_vs_raw"] = rounded(
                paired_ratio(times["ffmpeg fps=1 to raw RGB"], times["visbatch"])
            )
            checks.append(
                Check(
                    f"1 fps over a {dense_s} s {dense_size[1]}p video (keyframe every 8 s), frames/s vs "
                    "ffmpeg fps=1 (both writing PNG files)",
                    entry["speedup_vs_png"],
                    ">=",
                    1.0,
                    note=f"against ffmpeg to raw RGB on a pipe (no files): {entry['speedup_vs_raw']}x",
                )
            )
        figures["fps1"] = entry
        chart.update({f"1 fps, {dense_s} s: {k}": median(v) for k, v in times.items()})

        # 32 frames over the long video, and over a 10 s one.
        arms = {
            "visbatch 32 frames, 10 s": Arm(work, lambda o: visbatch(short, o, "--num-frames", "32")),
            f"visbatch 32 frames, {long_s} s": Arm(work, lambda o: visbatch(long, o, "--num-frames", "32")),
            "visbatch --keyframes 32 frames, 10 s": Arm(
                work, lambda o: visbatch(short, o, "--num-frames", "32", "--keyframes")
            ),
            f"visbatch --keyframes 32 frames, {long_s} s": Arm(
                work, lambda o: visbatch(long, o, "--num-frames", "32", "--keyframes")
            ),
        }
        if have_ffmpeg:
            arms[f"ffmpeg fps=32/{long_s} to PNG"] = Arm(work, lambda o: ffmpeg_png(long, o, f"32/{long_s}"))
        entry, times = timed_case(arms, args.reps)
        exact, snapped = f"visbatch 32 frames, {long_s} s", f"visbatch --keyframes 32 frames, {long_s} s"
        entry["long_over_10s"] = rounded(paired_ratio(times[exact], times["visbatch 32 frames, 10 s"]))
        entry["long_over_10s_keyframes"] = rounded(
            paired_ratio(times[snapped], times["visbatch --keyframes 32 frames, 10 s"])
        )
        if have_ffmpeg:
            ffmpeg = times[f"ffmpeg fps=32/{long_s} to PNG"]
            entry["speedup_vs_fps_filter"] = rounded(paired_ratio(ffmpeg, times[exact]))
            entry["speedup_vs_fps_filter_keyframes"] = rounded(paired_ratio(ffmpeg, times[snapped]))
            checks.append(
                Check(
                    f"32 frames over {long_s} s, speed vs ffmpeg fps=32/{long_s} (exact times)",
                    entry["speedup_vs_fps_filter"],
                    ">=",
                    5.0,
                    note=f"with --keyframes: {entry['speedup_vs_fps_filter_keyframes']}x",
                )
            )
        checks.append(
            Check(
                f"32 frames: time over a {long_s} s video / over a 10 s video (exact times)",
                entry["long_over_10s"],
                "<=",
                2.0,
                note=f"with --keyframes: {entry['long_over_10s_keyframes']}x",
            )
        )
        checks.append(
            Check(
                f"32 frames with --keyframes: time over a {long_s} s video / over a 10 s video",
                entry["long_over_10s_keyframes"],
                "<=",
                2.0,
            )
        )
        figures["frames32"] = entry
        chart.update({f"32 frames: {k}": median(v) for k, v in times.items()})

    if quick:
        notes.append(
            "quick mode: inputs too small for the targets (process start dominates); they are for full mode"
        )
    write_result(
        "video_frames",
        quick=quick,
        question="Video to sampled frames (PNG files, whole processes)",
        baseline="ffmpeg -vf fps=... to PNG files (and to raw RGB), process start included",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(
            list(chart), [rounded(v) for v in chart.values()], "seconds (lower is better)", "Q2 video"
        ),
        notes=notes,
    )


if __name__ == "__main__":
    main()
