"""Visual-token pruning in the transformers engine: kept tokens keep their original positions
(M-RoPE for Qwen, 1-D for Idefics3; prompt and decode steps), the output is deterministic, and
keep=1 changes nothing. Merging (tests/test_merging.py) goes through the same reduction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from worker.engines import EngineRequest, make_engine
from worker.tokens.pruning import kept_count, select_tokens
from worker.tokens.reduction import reduce_batch

pytestmark = pytest.mark.slow
NEW_TOKENS = 8


def visuals_of(adapter, sizes=((448, 448), (700, 300), (56, 56))):
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return adapter.encode(images)


def prompts_of(adapter, visuals, text="Describe this image."):
    return [adapter.prompt_ids(text, v) for v in visuals]


def language_model(adapter):
    inner = adapter.model.model
    return getattr(inner, "language_model", None) or inner.text_model


def generate(adapter, inputs, positions: list | None = None):
    """Greedy generate; `positions` collects the position_ids of every forward (prefill + decode)."""
    hook = None
    if positions is not None:

        def grab(_module, _args, kwargs):
            positions.append(kwargs["position_ids"].detach().clone())

        hook = language_model(adapter).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            out = adapter.model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=adapter.tokenizer.pad_token_id,
                eos_token_id=adapter.eos_token_ids,
                top_k=None,
            )
    finally:
        if hook is not None:
            hook.remove()
    return out[:, inputs["input_ids"].shape[1] :].tolist()


def reduce(adapter, visuals, prune_keeps, merge_keeps=None):
    inputs = adapter.generation_inputs(prompts_of(adapter, visuals), visuals)
    merge_keeps = merge_keeps or [1.0] * len(visuals)
    return inputs, reduce_batch(adapter, inputs, visuals, prune_keeps, merge_keeps)


def as_rows(positions: torch.Tensor) -> torch.Tensor:
    """position_ids as (rows, batch, length), whatever the family passes to generate."""
    return positions.unsqueeze(0) if positions.dim() == 2 else positions


def test_kept_tokens_keep_their_positions(family_adapter):
    adapter = family_adapter
    visuals = visuals_of(adapter)
    keeps = [0.5, 0.25, 0.75]
    inputs, reduced = reduce(adapter, visuals, keeps)
    pruned, full = reduced.inputs, reduced.full_positions
    image = adapter.image_token_id
    for row, (visual, keep) in enumerate(zip(visuals, keeps, strict=True)):
        cols = reduced.columns[row]
        at = pruned["input_ids"].shape[1] - len(cols)
        # Every kept column (text and image alike) carries the unpruned run's position there.
        assert torch.equal(as_rows(pruned["position_ids"])[:, row, at:], full[:, row, cols])
        assert torch.equal(pruned["input_ids"][row, at:], inputs["input_ids"][row, cols])
        assert pruned["attention_mask"][row, :at].sum() == 0 and pruned["attention_mask"][row, at:].all()
        kept_images = int((pruned["input_ids"][row] == image).sum())
        assert kept_images == kept_count(visual.num_tokens, keep) == visual.num_tokens - reduced.pruned[row]
        # The highest-norm tokens, in their original order.
        chosen = select_tokens(visual.embeds, keep)
        norms = visual.embeds.float().norm(dim=-1)
        others = [i for i in range(visual.num_tokens) if i not in set(chosen.tolist())]
        assert norms[chosen].min() >= norms[others].max()
        assert torch.equal(reduced.plans[row][0].kept, chosen)
    fed = pruned["mm_encoder_outputs"]["image"].pooler_output
    fed = fed if isinstance(fed, torch.Tensor) else torch.cat(fed)
    assert fed.shape[0] == sum(kept_count(v.num_tokens, k) for v, k in zip(visuals, keeps, strict=True))
    assert reduced.merged == [0, 0, 0]


def test_decode_steps_continue_where_the_unpruned_run_does(family_adapter):
    adapter = family_adapter
    visuals = visuals_of(adapter)
    _, reduced = reduce(adapter, visuals, [0.5, 0.5, 0.5])
    full_steps: list = []
    pruned_steps: list = []
    generate(adapter, adapter.generation_inputs(prompts_of(adapter, visuals), visuals), full_steps)
    generate(adapter, reduced.inputs, pruned_steps)
    assert len(full_steps) == len(pruned_steps) == NEW_TOKENS
    rows = as_rows(pruned_steps[0]).shape[0]  # M-RoPE: 3, 1-D: 1
    for step in range(1, NEW_TOKENS):  # decode steps: one new token per row
        # The default path may pass an extra first row (text positions for the mask).
        full, pruned = as_rows(full_steps[step]), as_rows(pruned_steps[step])
        assert torch.equal(full[-rows:, :, -1], pruned[-rows:, :, -1]), step


def test_output_is_deterministic_and_keep_one_is_the_plain_path(family_adapter):
    adapter = family_adapter
    visuals = visuals_of(adapter)
    plain = generate(adapter, adapter.generation_inputs(prompts_of(adapter, visuals), visuals))
    _, same = reduce(adapter, visuals, [1.0, 1.0, 1.0])
    assert same.pruned == [0, 0, 0]
    assert generate(adapter, same.inputs) == plain  # explicit positions reproduce the default path
    _, half = reduce(adapter, visuals, [0.5, 0.5, 0.5])
    assert generate(adapter, half.inputs) == generate(adapter, half.inputs)


def test_engine_prunes_per_request_and_reports_it(tiny_adapter):
    visuals = visuals_of(tiny_adapter, sizes=((448, 448), (280, 280)))
    engine = make_engine("transformers", tiny_adapter)

    def requests(keep):
        return [
            EngineRequest(
                prompt_ids=tiny_adapter.prompt_ids("What is this?", v),
                visual=v,
                cache_key=str(i),
                max_new_tokens=NEW_TOKENS,
                prune_keep=keep,
            )
            for i, v in enumerate(visuals)
        ]

    first, again = engine.generate(requests(0.5)), engine.generate(requests(0.5))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.pruned_tokens for g in first] == [v.num_tokens - kept_count(v.num_tokens, 0.5) for v in visuals]
    assert [g.merged_tokens for g in first] == [0, 0]
    assert [g.pruned_tokens for g in engine.generate(requests(1.0))] == [0, 0]
