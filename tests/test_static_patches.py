"""A window's static patches sent once (`--drop-static D`, issue 34): inside a window of frames,
a token that changed by less than D (relative L2) since the window last showed its grid position
is left out of the LM input, every other token at its original position (the reduction pruning
uses: worker.tokens.reduction), on the transformers engine. Off (0) changes nothing; a job
without windows is refused with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ingest.spec import JobSpec, Sampling
from tests.test_cached_equals_pixels import window_through_cache
from tests.test_pruning import as_rows
from worker.engines import EngineRequest, make_engine
from worker.tokens.reduction import plan_reduction, plan_static, reduce_batch

PROMPT = "What happens in this clip?"


def test_a_token_is_dropped_until_it_drifts_from_what_the_window_showed() -> None:
    first = torch.ones(4, 3)
    same = first.clone()
    moved = first.clone()
    moved[2] *= 3  # one patch changed
    drift = [moved * (1 + 0.04 * step) for step in range(1, 4)]  # 4 % a frame, all patches
    plans = plan_static([first, same, moved, *drift], drop_static=0.1)
    assert plans[0].kept.tolist() == [0, 1, 2, 3] and plans[0].pruned == 0  # the first frame whole
    assert len(plans[1].kept) == 1 and plans[1].pruned == 3  # nothing changed: one token still shown
    assert plans[2].kept.tolist() == [2]  # the moved patch alone
    # 4 % and 8 % since what was shown stay out (one token still shown a frame); at 12 % the
    # patches not shown since are shown again: the change is measured against what the LM last
    # saw, so a slow drift is never lost.
    assert [len(p.kept) for p in plans[3:5]] == [1, 1] and len(plans[5].kept) >= 2
    assert set().union(*(p.kept.tolist() for p in plans[3:])) == {0, 1, 2, 3}
    assert all(p.merged == 0 for p in plans)
    # Off: every token of every frame.
    assert all(p.pruned == 0 for p in plan_static([first, same, moved], drop_static=0.0))
    # A frame of another token count starts over.
    assert plan_static([first, torch.ones(6, 3)], drop_static=0.5)[1].pruned == 0


def _frames(adapter, count: int = 3) -> list:
    """Frames of one 224x224 scene in which one corner changes from frame to frame."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)
    images = []
    for i in range(count):
        frame = base.copy()
        frame[:56, :56] = rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) if i else frame[:56, :56]
        images.append(Image.fromarray(frame))
    return window_through_cache(adapter, images)


@pytest.mark.slow
def test_kept_tokens_keep_their_positions_and_off_is_the_plain_window(family_adapter) -> None:
    adapter = family_adapter
    window = tuple(_frames(adapter))
    prompt = adapter.prompt_ids(PROMPT, window)
    inputs = adapter.generation_inputs([prompt], list(window))
    reduced = reduce_batch(adapter, inputs, [window], [1.0], [1.0], [0.05])
    (plans,) = reduced.plans
    assert plans[0].pruned == 0 and sum(p.pruned for p in plans[1:]) > 0, [p.pruned for p in plans]
    assert reduced.pruned == [sum(p.pruned for p in plans)]
    _assert_positions_kept(adapter, inputs, reduced, window)

    def ask(drop_static: float) -> list:
        request = EngineRequest(prompt, window, "w", max_new_tokens=6, drop_static=drop_static)
        return make_engine("transformers", adapter).generate([request, request])

    off, on = ask(0.0), ask(0.05)
    plain = make_engine("transformers", adapter).generate(
        [EngineRequest(prompt, window, "w", max_new_tokens=6)]
    )
    assert off[0].token_ids == plain[0].token_ids and off[0].pruned_tokens == 0  # off: the plain window
    assert on[0].pruned_tokens == reduced.pruned[0] and on[0].token_ids == on[1].token_ids  # deterministic
    assert on[0].error is None


def _assert_positions_kept(adapter, inputs, reduced, window) -> None:
    cols = reduced.columns[0]
    at = reduced.inputs["input_ids"].shape[1] - len(cols)
    # Every kept column (text and image alike) carries the full window's position there.
    assert torch.equal(as_rows(reduced.inputs["position_ids"])[:, 0, at:], reduced.full_positions[:, 0, cols])
    assert torch.equal(reduced.inputs["input_ids"][0, at:], inputs["input_ids"][0, cols])
    kept = int((reduced.inputs["input_ids"][0] == adapter.image_token_id).sum())
    assert kept == sum(v.num_tokens for v in window) - reduced.pruned[0] - reduced.merged[0]


@pytest.mark.slow
def test_a_windows_frames_are_pruned_and_merged_each_on_its_own(family_adapter) -> None:
    """--prune-keep and --merge-keep inside a window: each frame reduced as a page alone would
    be, every kept token at its full-window position."""
    adapter = family_adapter
    window = tuple(_frames(adapter))
    prompt = adapter.prompt_ids(PROMPT, window)
    inputs = adapter.generation_inputs([prompt], list(window))
    for prune_keep, merge_keep in ((0.5, 1.0), (1.0, 0.5)):
        reduced = reduce_batch(adapter, inputs, [window], [prune_keep], [merge_keep])
        (plans,) = reduced.plans
        alone = [plan_reduction(v.embeds, adapter.token_rows(v), prune_keep, merge_keep) for v in window]
        assert [(p.pruned, p.merged) for p in plans] == [(p.pruned, p.merged) for p in alone]
        assert reduced.pruned[0] + reduced.merged[0] > 0
        _assert_positions_kept(adapter, inputs, reduced, window)
        request = EngineRequest(
            prompt, window, "w", max_new_tokens=6, prune_keep=prune_keep, merge_keep=merge_keep
        )
        (got,) = make_engine("transformers", adapter).generate([request])
        assert got.error is None and (got.pruned_tokens, got.merged_tokens) == (
            reduced.pruned[0],
            reduced.merged[0],
        )


@pytest.mark.slow
def test_a_job_of_video_windows_records_the_tokens_left_out(settings_factory, tmp_path) -> None:
    from storage import repository as repo
    from tests.media import write_video
    from worker.drivers.embedded import run_job
    from worker.runtime import Runtime

    inputs = tmp_path / "in"
    inputs.mkdir()
    write_video(inputs / "clip.mp4", seconds=4)
    rt = Runtime(settings_factory())
    spec = JobSpec(prompts=[PROMPT], window="4", sampling=Sampling(max_new_tokens=4))

    def run(**reduction: float) -> list[dict]:
        budget = spec.budget.model_copy(update={**reduction, "skip_redundant_frames": False})
        job = run_job(rt, [inputs], spec.model_copy(update={"budget": budget}))
        assert repo.job_summary(rt.db, job)["status"] == "succeeded"
        return list(repo.iter_results(rt.db, job))

    full, dropped, pruned = run(), run(drop_static=0.5), run(prune_keep=0.5)
    assert [r["scope"] for r in dropped] == ["window"] * len(full)
    assert all(r["pruned_tokens"] == 0 for r in full)
    assert sum(r["pruned_tokens"] for r in dropped) > 0
    # --prune-keep in a window: each frame pruned on its own, to about half.
    assert all(0.4 < r["pruned_tokens"] / r["visual_tokens"] < 0.6 for r in pruned), pruned
    assert [r["visual_tokens"] for r in dropped] == [r["visual_tokens"] for r in full]


def test_drop_static_without_windows_is_refused(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from tests.media import write_video
    from worker.cli.main import app

    monkeypatch.setenv("VISBATCH_HOME", str(tmp_path / "home"))
    clip = write_video(tmp_path / "clip.mp4", seconds=2)
    args = ["run", str(clip), "--model", str(tiny_model_dir), "-p", "q", "--drop-static", "0.1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "--drop-static 0.1" in result.output and "add --window" in result.output
    result = CliRunner().invoke(app, [*args, "--window", "1"])
    assert result.exit_code == 2, result.output
    # With windows, `plan` counts the full windows and says a run may give the LM fewer.
    planned = CliRunner().invoke(app, ["plan", *args[1:], "--window", "2"])
    assert planned.exit_code == 0, planned.output
    assert "--drop-static is on: a run may give the LM fewer visual tokens (upper bound)" in planned.output
