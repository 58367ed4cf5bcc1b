"""Visual-token pruning for M-RoPE models (Qwen2-VL family), transformers engine only.

Keeps a fraction of each image's visual tokens, chosen by a score (the L2 norm of the merged
embedding: cheap, needs no attention maps, deterministic), and drops the others from the
language model's input. Every kept token keeps its ORIGINAL 3-D rotary position, and the text
after the image keeps its original positions too, so the model sees the same geometry with
holes in it rather than a smaller, shifted image:

1. positions of the full (unpruned) batch from the model's own ``get_rope_index``;
2. the pruned columns are removed from ``input_ids``, the attention mask, ``mm_token_type_ids``
   and the positions alike, and each row is left-padded again;
3. ``generate`` gets those ``position_ids`` explicitly; transformers then continues each decode
   step at the last position + 1, which is exactly where the unpruned run continues (the last
   prompt token is text, at the row's maximum position).

vLLM cannot take this: it sizes an image's placeholder run from ``image_grid_thw`` (t*h*w/4
tokens) and computes the positions itself, so fewer embeddings than the grid implies is a shape
error there (see ``worker.engines.vllm_engine``: pruning is ignored with a warning).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from worker.visual_tokens import VisualTokens


def kept_count(num_tokens: int, keep: float) -> int:
    """Tokens kept of ``num_tokens`` at fraction ``keep`` (at least one)."""
    if keep >= 1.0:
        return num_tokens
    return max(1, min(num_tokens, math.ceil(num_tokens * keep - 1e-9)))


def select_tokens(embeds: torch.Tensor, keep: float) -> torch.Tensor:
    """Indices (ascending) of the tokens to keep: the highest L2 norms, ties to the earlier token."""
    n = int(embeds.shape[0])
    k = kept_count(n, keep)
    if k == n:
        return torch.arange(n)
    scores = embeds.detach().float().norm(dim=-1).cpu()
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:k].sort().values


def full_positions(model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids (3, batch, length), rope_deltas) of the unpruned batch, as the model computes them."""
    return model.model.get_rope_index(
        input_ids=inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )


def prune_inputs(
    model: Any,
    inputs: dict[str, Any],
    visuals: list[VisualTokens],
    keeps: list[float],
    *,
    image_token_id: int,
    pad_token_id: int,
) -> tuple[dict[str, Any], list[int], list[torch.Tensor]]:
    """The batch with each row's image pruned to ``keeps[row]``; positions given explicitly.

    ``inputs`` are the adapter's full generation inputs (left-padded, one image per row).
    Returns (new inputs, tokens pruned per row, kept column indices of each row in the FULL
    batch) - the last is what a test compares positions with.
    """
    positions, _ = full_positions(model, inputs)
    input_ids, attention = inputs["input_ids"], inputs["attention_mask"]
    token_types = inputs["mm_token_type_ids"]
    device = input_ids.device
    columns: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    pruned: list[int] = []
    for row, (visual, keep) in enumerate(zip(visuals, keeps, strict=True)):
        image_cols = (input_ids[row] == image_token_id).nonzero().flatten().cpu()
        if len(image_cols) != visual.num_tokens:
            raise ValueError(f"row {row}: {len(image_cols)} image placeholders, {visual.num_tokens} tokens")
        kept = select_tokens(visual.embeds, keep)
        dropped = torch.ones(len(image_cols), dtype=torch.bool)
        dropped[kept] = False
        keep_col = attention[row].bool().cpu().clone()
        keep_col[image_cols[dropped]] = False
        columns.append(keep_col.nonzero().flatten())
        embeds.append(visual.embeds[kept])
        pruned.append(int(dropped.sum()))
    width = max(len(c) for c in columns)
    batch = len(visuals)
    new_ids = torch.full((batch, width), pad_token_id, dtype=input_ids.dtype)
    new_mask = torch.zeros((batch, width), dtype=attention.dtype)
    new_types = torch.zeros((batch, width), dtype=token_types.dtype)
    new_positions = torch.zeros((3, batch, width), dtype=positions.dtype)
    for row, cols in enumerate(columns):
        at = width - len(cols)  # left padding again
        new_ids[row, at:] = input_ids[row, cols.to(device)].cpu()
        new_mask[row, at:] = 1
        new_types[row, at:] = token_types[row, cols.to(device)].cpu()
        new_positions[:, row, at:] = positions[:, row, cols.to(positions.device)].cpu()
    pruned_inputs = {
        **inputs,
        "input_ids": new_ids.to(device),
        "attention_mask": new_mask.to(device),
        "mm_token_type_ids": new_types.to(device),
        # Explicit positions: generate uses them for the prompt and continues at last + 1.
        "position_ids": new_positions.to(device),
        "mm_encoder_outputs": {
            "image": BaseModelOutputWithPooling(pooler_output=tuple(e.to(device) for e in embeds))
        },
    }
    return pruned_inputs, pruned, columns
