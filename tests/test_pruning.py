"""Visual-token pruning in the transformers engine: kept tokens keep their original M-RoPE
positions (prompt and decode steps), the output is deterministic, and keep=1 changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from worker.engines import EngineRequest, make_engine
from worker.pruning import full_positions, kept_count, prune_inputs, select_tokens

pytestmark = pytest.mark.slow
NEW_TOKENS = 8


def _visuals(adapter, sizes=((448, 448), (700, 300), (56, 56))):
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    return adapter.encode(images)


def _prompts(adapter, visuals, text="Describe this image."):
    return [adapter.prompt_ids(text, v.num_tokens) for v in visuals]


def _generate(adapter, inputs, positions: list | None = None):
    """Greedy generate; `positions` collects the position_ids of every forward (prefill + decode)."""
    hook = None
    if positions is not None:

        def grab(_module, _args, kwargs):
            positions.append(kwargs["position_ids"].detach().clone())

        hook = adapter.model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
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


def _prune(adapter, visuals, keeps):
    inputs = adapter.generation_inputs(_prompts(adapter, visuals), visuals)
    full, _ = full_positions(adapter.model, inputs)
    pruned, dropped, columns = prune_inputs(
        adapter.model,
        inputs,
        visuals,
        keeps,
        image_token_id=adapter.image_token_id,
        pad_token_id=adapter.tokenizer.pad_token_id,
    )
    return inputs, full, pruned, dropped, columns


def test_kept_tokens_keep_their_positions(tiny_adapter):
    visuals = _visuals(tiny_adapter)
    keeps = [0.5, 0.25, 0.75]
    inputs, full, pruned, dropped, columns = _prune(tiny_adapter, visuals, keeps)
    image = tiny_adapter.image_token_id
    for row, (visual, keep) in enumerate(zip(visuals, keeps, strict=True)):
        cols = columns[row]
        at = pruned["input_ids"].shape[1] - len(cols)
        # Every kept column (text and image alike) carries the unpruned run's position there.
        assert torch.equal(pruned["position_ids"][:, row, at:], full[:, row, cols])
        assert torch.equal(pruned["input_ids"][row, at:], inputs["input_ids"][row, cols])
        assert pruned["attention_mask"][row, :at].sum() == 0 and pruned["attention_mask"][row, at:].all()
        kept_images = int((pruned["input_ids"][row] == image).sum())
        assert kept_images == kept_count(visual.num_tokens, keep) == visual.num_tokens - dropped[row]
        # The highest-norm tokens, in their original order.
        chosen = select_tokens(visual.embeds, keep)
        norms = visual.embeds.float().norm(dim=-1)
        assert (
            norms[chosen].min()
            >= norms[[i for i in range(visual.num_tokens) if i not in set(chosen.tolist())]].max()
        )
    fed = torch.cat(pruned["mm_encoder_outputs"]["image"].pooler_output)
    assert fed.shape[0] == sum(kept_count(v.num_tokens, k) for v, k in zip(visuals, keeps, strict=True))


def test_decode_steps_continue_where_the_unpruned_run_does(tiny_adapter):
    visuals = _visuals(tiny_adapter)
    _, _, pruned, _, _ = _prune(tiny_adapter, visuals, [0.5, 0.5, 0.5])
    full_steps: list = []
    pruned_steps: list = []
    _generate(
        tiny_adapter, tiny_adapter.generation_inputs(_prompts(tiny_adapter, visuals), visuals), full_steps
    )
    _generate(tiny_adapter, pruned, pruned_steps)
    assert len(full_steps) == len(pruned_steps) == NEW_TOKENS
    for step in range(1, NEW_TOKENS):  # decode steps: one new token per row
        # The default path passes 4 rows (text positions for the mask, then the 3 M-RoPE rows).
        assert torch.equal(full_steps[step][-3:, :, -1], pruned_steps[step][-3:, :, -1]), step


def test_output_is_deterministic_and_keep_one_is_the_plain_path(tiny_adapter):
    visuals = _visuals(tiny_adapter)
    plain = _generate(tiny_adapter, tiny_adapter.generation_inputs(_prompts(tiny_adapter, visuals), visuals))
    _, _, same, dropped, _ = _prune(tiny_adapter, visuals, [1.0, 1.0, 1.0])
    assert dropped == [0, 0, 0]
    assert _generate(tiny_adapter, same) == plain  # explicit positions reproduce the default path
    _, _, half, _, _ = _prune(tiny_adapter, visuals, [0.5, 0.5, 0.5])
    assert _generate(tiny_adapter, half) == _generate(tiny_adapter, half)


def test_engine_prunes_per_request_and_reports_it(tiny_adapter):
    visuals = _visuals(tiny_adapter, sizes=((448, 448), (280, 280)))
    engine = make_engine("transformers", tiny_adapter)

    def requests(keep):
        return [
            EngineRequest(
                prompt_ids=tiny_adapter.prompt_ids("What is this?", v.num_tokens),
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
    assert [g.pruned_tokens for g in engine.generate(requests(1.0))] == [0, 0]
