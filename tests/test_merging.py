"""Visual-token merging in the transformers engine: the most similar neighbours in a grid row are
averaged until the kept share remains; each merged token sits at its run's middle member's
ORIGINAL position (M-RoPE consistent), extras (Qwen3-VL deepstack) are averaged alike, merging
and pruning combine, keep=1 changes nothing, and the result is deterministic."""

from __future__ import annotations

import pytest
import torch

from tests.test_pruning import as_rows, generate, prompts_of, reduce, visuals_of
from worker.engines import EngineRequest, make_engine
from worker.tokens.merging import merge_runs, run_position
from worker.tokens.pruning import kept_count
from worker.tokens.reduction import plan_reduction, reduce_batch

# --- the rule itself, on hand-made embeddings ------------------------------------------------


def _tokens(*vectors) -> torch.Tensor:
    return torch.tensor(vectors, dtype=torch.float32)


def test_the_most_similar_neighbours_merge_first():
    x = _tokens([1, 0], [0, 1], [1, 1], [1, 1.01], [-1, 0], [0, -1])
    assert merge_runs(x, [6], keep=5 / 6) == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]
    # Then the merged run is compared by its mean: [1, 1.005] is closest to [0, 1] next.
    assert merge_runs(x, [6], keep=4 / 6) == [(0, 1), (1, 4), (4, 5), (5, 6)]


def test_no_merge_across_a_grid_row():
    # The end of row 0 and the start of row 1 are identical, everything else is dissimilar.
    x = _tokens([1, 0], [0, 1], [5, 5], [5, 5], [-1, 0], [0, -1])
    runs = merge_runs(x, [3, 3], keep=5 / 6)
    assert (2, 4) not in runs and len(runs) == 5
    for start, end in merge_runs(x, [3, 3], keep=0.01):  # down to the floor: one run per row
        assert end <= 3 or start >= 3
    assert merge_runs(x, [3, 3], keep=0.01) == [(0, 3), (3, 6)]


def test_runs_cover_every_token_in_order_and_ties_go_left():
    x = torch.ones(8, 4)  # all alike: every pair ties
    runs = merge_runs(x, [8], keep=0.5)
    assert runs == [(0, 5), (5, 6), (6, 7), (7, 8)]
    assert merge_runs(x, [8], keep=0.5) == runs  # deterministic
    y = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    runs = merge_runs(y, [10] * 4, keep=0.3)
    assert len(runs) == kept_count(40, 0.3)
    assert [s for s, _ in runs] == [0] + [e for _, e in runs[:-1]] and runs[-1][1] == 40
    assert merge_runs(y, [10] * 4, keep=1.0) == [(i, i + 1) for i in range(40)]


def test_a_merged_token_takes_its_middle_members_place():
    assert [run_position(0, 1), run_position(3, 6), run_position(3, 7)] == [0, 4, 4]
    x = _tokens([1, 0], [1, 0.01], [1, 0.02], [0, 1])
    plan = plan_reduction(x, [4], prune_keep=1.0, merge_keep=0.5)  # (0, 3) merged, then (3, 4)
    assert plan.kept.tolist() == [1, 3] and plan.merged == 2 and plan.pruned == 0
    assert torch.allclose(plan.apply(x), torch.stack([x[:3].mean(0), x[3]]))


def test_merging_then_pruning():
    y = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    plan = plan_reduction(y, [8] * 8, prune_keep=0.5, merge_keep=0.5)
    assert plan.merged == 64 - 32 and plan.pruned == 16 and len(plan.kept) == 16
    assert int((plan.group >= 0).sum()) < 64  # the pruned runs' tokens belong to no kept token


# --- in the model: positions, extras, generation ---------------------------------------------


@pytest.mark.slow
def test_merged_tokens_keep_m_rope_consistent_positions(family_adapter):
    adapter = family_adapter
    visuals = visuals_of(adapter)
    keeps = [0.5, 0.3, 0.7]
    inputs, reduced = reduce(adapter, visuals, [1.0] * 3, keeps)
    full = reduced.full_positions
    fed = reduced.inputs["mm_encoder_outputs"]["image"]
    per_image = fed.pooler_output  # per image, or (Idefics3) one tensor for the batch
    if isinstance(per_image, torch.Tensor):
        per_image = torch.split(per_image, [len(p.kept) for (p,) in reduced.plans])
    for row, (visual, keep) in enumerate(zip(visuals, keeps, strict=True)):
        plan = reduced.plans[row][0]
        floor = len(adapter.token_rows(visual))
        assert len(plan.kept) == max(kept_count(visual.num_tokens, keep), min(floor, visual.num_tokens))
        assert reduced.merged[row] == visual.num_tokens - len(plan.kept) and reduced.pruned[row] == 0
        image_cols = (inputs["input_ids"][row] == adapter.image_token_id).nonzero().flatten()
        cols = reduced.columns[row]
        at = reduced.inputs["input_ids"].shape[1] - len(cols)
        # Every remaining column carries the full run's position at that column.
        assert torch.equal(as_rows(reduced.inputs["position_ids"])[:, row, at:], full[:, row, cols])
        for slot, token in enumerate(plan.kept.tolist()):
            members = (plan.group == slot).nonzero().flatten()
            assert token == run_position(int(members[0]), int(members[-1]) + 1)
            assert torch.equal(members, torch.arange(int(members[0]), int(members[-1]) + 1))  # one run
            where = full[:, row, image_cols[members]]
            here = full[:, row, image_cols[token]]
            if where.shape[0] == 3:  # M-RoPE: same time and row as every member, a column among theirs
                assert (where[:2] == here[:2, None]).all()
                assert where[2].min() <= here[2] <= where[2].max()
            else:  # 1-D: a position among its members'
                assert where[0].min() <= here[0] <= where[0].max()
            mean = visual.embeds[members].float().mean(0)
            assert torch.allclose(per_image[row][slot].float(), mean, atol=1e-5)
            for name, extra in visual.extras.items():  # Qwen3-VL deepstack: averaged alike
                layers = getattr(fed, "deepstack_features", None) if name == "deepstack" else None
                assert layers is not None
                for layer, maps in enumerate(layers):
                    assert torch.allclose(
                        maps[row][slot].float(), extra[layer, members].float().mean(0), atol=1e-5
                    )


@pytest.mark.slow
def test_merged_decode_continues_and_keep_one_is_the_plain_path(family_adapter):
    adapter = family_adapter
    visuals = visuals_of(adapter)
    plain_inputs = adapter.generation_inputs(prompts_of(adapter, visuals), visuals)
    full_steps: list = []
    plain = generate(adapter, plain_inputs, full_steps)
    _, same = reduce(adapter, visuals, [1.0] * 3, [1.0] * 3)
    assert same.merged == [0, 0, 0]
    assert generate(adapter, same.inputs) == plain
    _, merged = reduce(adapter, visuals, [1.0] * 3, [0.5] * 3)
    steps: list = []
    out = generate(adapter, merged.inputs, steps)
    assert out == generate(adapter, merged.inputs)  # deterministic
    rows = as_rows(steps[0]).shape[0]
    for step in range(1, len(steps)):
        assert torch.equal(as_rows(full_steps[step])[-rows:, :, -1], as_rows(steps[step])[-rows:, :, -1])
    again = reduce_batch(adapter, plain_inputs, visuals, [1.0] * 3, [0.5] * 3)
    assert [p.kept.tolist() for (p,) in again.plans] == [p.kept.tolist() for (p,) in merged.plans]


@pytest.mark.slow
def test_engine_merges_and_prunes_per_request_and_reports_both(tiny_adapter):
    visuals = visuals_of(tiny_adapter, sizes=((448, 448), (280, 280)))
    engine = make_engine("transformers", tiny_adapter)

    def requests(prune, merge):
        return [
            EngineRequest(
                prompt_ids=tiny_adapter.prompt_ids("What is this?", v),
                visual=v,
                cache_key=str(i),
                max_new_tokens=8,
                prune_keep=prune,
                merge_keep=merge,
            )
            for i, v in enumerate(visuals)
        ]

    merged = engine.generate(requests(1.0, 0.5))
    assert [g.merged_tokens for g in merged] == [
        v.num_tokens - kept_count(v.num_tokens, 0.5) for v in visuals
    ]
    assert [g.pruned_tokens for g in merged] == [0, 0]
    both = engine.generate(requests(0.5, 0.5))
    for gen, v in zip(both, visuals, strict=True):
        left = kept_count(v.num_tokens, 0.5)
        assert gen.merged_tokens == v.num_tokens - left
        assert gen.pruned_tokens == left - kept_count(left, 0.5)
    assert [g.token_ids for g in both] == [g.token_ids for g in engine.generate(requests(0.5, 0.5))]
    assert [(g.pruned_tokens, g.merged_tokens) for g in engine.generate(requests(1.0, 1.0))] == [
        (0, 0),
        (0, 0),
    ]
