"""Issue 34. A video asked in 10-second windows against the same frames one by one.

The same frames (a 10-minute video sampled at 1 fps: 600 frames of 640x360; --quick: 2 minutes)
go through the same TransformersEngine twice, packed as the engine packs its queue: once one
request per frame, once one request per window of 10 consecutive frames (ingest.windows, `10s`),
each request built by the adapter from the frames' visual tokens as the generate stage builds
it. The figure is the issue's: visual tokens through the engine per second, windows against
frames (>= 0.9x); and requests, prompt tokens and decode steps each arm costs. Visual tokens are
random embeddings of each frame's exact token shape (the tower is not what is measured: each
frame is encoded once in both arms). The model is the ~100M-parameter random Qwen2-VL of
bench/models.py, so compute dominates on a CPU as it does on a GPU.
"""

from __future__ import annotations

import torch

from bench.common import Check, arguments, bars, interleaved, median, paired_ratio, rounded, write_result
from bench.embedded import quiet
from bench.models import bench_model, parameter_count
from ingest.windows import parse_window, windows_of
from worker.engines.base import EngineRequest
from worker.engines.transformers_engine import TransformersEngine
from worker.models import ModelRef, load_adapter
from worker.tokens.tensors import VisualTokens

PROMPT = "What happens here? Answer in one sentence."
NEW_TOKENS = 16
FRAME = (640, 360)


def frame_tokens(adapter, frames: int) -> list[VisualTokens]:
    """Random embeddings of a 640x360 frame's exact token shape, one per frame."""
    gen = torch.Generator().manual_seed(0)
    patch = adapter.processor.image_processor.patch_size
    w, h = adapter.token_rule.resized(*FRAME)
    grid = torch.tensor([[1, h // patch, w // patch]], dtype=torch.int64)
    n = int(grid.prod()) // adapter.merge_size**2
    return [VisualTokens(torch.randn(n, adapter.hidden_size, generator=gen), grid) for _ in range(frames)]


def requests_of(adapter, frames: list[VisualTokens], window: str | None) -> list[EngineRequest]:
    if window is None:
        spans = [(i, i) for i in range(len(frames))]
    else:
        spans = windows_of(parse_window(window), [float(i) for i in range(len(frames))])  # 1 fps
    out = []
    for first, last in spans:
        images = tuple(frames[first : last + 1])
        visual = images if window is not None else images[0]
        out.append(EngineRequest(adapter.prompt_ids(PROMPT, visual), visual, f"{first}-{last}", NEW_TOKENS))
    return out


def main() -> None:
    args = arguments(__doc__, default_reps=3, quick_reps=2)
    seconds_of_video = 120 if args.quick else 600
    quiet()
    folder = bench_model("lm100m")
    adapter = load_adapter(ModelRef(str(folder), device="cpu"))
    frames = frame_tokens(adapter, seconds_of_video)
    arms = {
        "one frame a request": requests_of(adapter, frames, None),
        "10-s windows": requests_of(adapter, frames, "10s"),
    }
    visual = {name: sum(r.visual_tokens for r in reqs) for name, reqs in arms.items()}
    assert len(set(visual.values())) == 1, visual  # the same frames, each once, in both arms
    engine = TransformersEngine(adapter)

    def run(requests: list[EngineRequest]) -> list:
        for i, request in enumerate(requests):
            engine.add(str(i), request)
        done = []
        while engine.unfinished:
            done += engine.step()
        assert len(done) == len(requests) and not any(g.error for _, g in done), [g.error for _, g in done]
        return done

    run(arms["10-s windows"][:2])  # warm-up (first-call allocations), untimed
    seconds = interleaved({name: (lambda _rep, r=reqs: run(r)) for name, reqs in arms.items()}, args.reps)
    names = list(arms)
    ratio = paired_ratio(seconds[names[0]], seconds[names[1]])  # frames' time / windows' time
    per_second = {name: rounded(visual[name] / median(s)) for name, s in seconds.items()}
    figures = {
        "model_parameters_m": round(parameter_count(folder) / 1e6, 1),
        "video_seconds_at_1_fps": seconds_of_video,
        "frame": f"{FRAME[0]}x{FRAME[1]}",
        "visual_tokens_per_frame": frames[0].num_tokens,
        "requests": {name: len(reqs) for name, reqs in arms.items()},
        "visual_tokens": visual,
        "prompt_tokens": {
            name: sum(len(r.prompt_ids) - r.visual_tokens for r in reqs) for name, reqs in arms.items()
        },
        "decode_steps_at_most": {name: len(reqs) * NEW_TOKENS for name, reqs in arms.items()},
        "timings": seconds.rounded(),
        "visual_tokens_per_s": per_second,
        "windows_vs_frames": rounded(ratio),
    }
    checks = [
        Check(
            "visual tokens/s through the engine, 10-s windows / one frame a request",
            rounded(ratio),
            ">=",
            0.9,
        )
    ]
    write_result(
        "windows",
        quick=args.quick,
        question="A video in 10-s windows against its frames one by one",
        baseline="the same frames, one request each, same engine and packing",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(names, [per_second[n] for n in names], "visual tokens/s", "issue 34: windows vs frames"),
        notes=[
            f"{len(arms[names[1]])} windows of 10 frames against {len(arms[names[0]])} requests of one frame"
        ],
    )


if __name__ == "__main__":
    main()
