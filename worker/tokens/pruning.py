"""Visual-token pruning: which of an image's tokens to drop (transformers engine only).

Keeps a fraction of each image's visual tokens, chosen by a score (the L2 norm of the
embedding: cheap, needs no attention maps, deterministic), and drops the others from the
language model's input. How the kept tokens keep their ORIGINAL positions (M-RoPE for Qwen,
1-D for Idefics3), so the model sees the same geometry with holes in it rather than a smaller,
shifted image, is ``worker.tokens.reduction``'s part, shared with merging (``worker.tokens.merging``).

vLLM cannot take this: it sizes an image's placeholder run from ``image_grid_thw`` (t*h*w/4
tokens) and computes the positions itself, so fewer embeddings than the grid implies is a shape
error there (see ``worker.engines.vllm_engine``: pruning is ignored with a warning).
"""

from __future__ import annotations

import math

import torch


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
