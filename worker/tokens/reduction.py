"""Fewer visual tokens to the language model, every one at its ORIGINAL position (transformers engine).

Merging (``worker.tokens.merging``) and pruning (``worker.tokens.pruning``) combine: each image is first
merged to ``merge_keep`` of its tokens (neighbours in the full grid, where adjacency means
something), then the merged tokens are pruned to ``prune_keep`` of them (by the L2 norm of what
they now carry). Either fraction at 1 leaves that step out. The result is a ``ReductionPlan``:
which tokens' columns stay, and which original tokens each one averages.

Static patches (``drop_static`` > 0, a window of frames): a frame's token is dropped when it
differs from what the window last showed at the same grid position (the previous frames' latest
kept token there) by less than ``drop_static``, relative L2 (``plan_static``); the window's
first frame, and a frame of another grid than the one before, are kept whole. Dropped tokens
count as pruned.

The batch is then rebuilt, family-neutrally, from what the adapter says:

1. positions of the full batch from ``adapter.prompt_positions`` (Qwen: the model's own M-RoPE
   ``get_rope_index``; Idefics3: 1-D positions);
2. the columns of dropped image tokens are removed from ``input_ids``, the attention mask, the
   adapter's other per-column inputs and the positions alike, and each row is left-padded again;
3. the embeddings (and per-token extras such as Qwen3-VL's deepstack features) are averaged per
   kept token and injected through ``adapter.mm_encoder_outputs``;
4. ``generate`` gets those ``position_ids`` explicitly; transformers then continues each decode
   step at the last position + 1, which is exactly where the full run continues (the last prompt
   token is text, at the row's maximum position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.tokens.merging import merge_runs, run_position
from worker.tokens.pruning import select_tokens
from worker.tokens.tensors import VisualTokens


class ReducibleModel(Protocol):
    """What reduction needs of a model (its adapter, handed in: tokens sit below models)."""

    image_token_id: int
    column_inputs: tuple[str, ...]
    dtype: Any
    tokenizer: Any

    def prompt_positions(self, inputs: dict[str, Any]) -> Any: ...

    def token_rows(self, visual: VisualTokens) -> list[int]: ...

    def positions_for_generate(self, positions: torch.Tensor) -> Any: ...

    def mm_encoder_outputs(
        self, embeds: list[torch.Tensor], extras: list[dict[str, torch.Tensor]]
    ) -> Any: ...


@dataclass(frozen=True)
class ReductionPlan:
    """What one image's tokens become."""

    num_tokens: int
    kept: torch.Tensor  # (k,) ascending: the tokens whose columns and positions stay
    group: torch.Tensor  # (num_tokens,) the kept token each token is averaged into; -1: pruned
    merged: int  # tokens merged into a neighbour
    pruned: int  # tokens dropped (after merging)

    def apply(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`tensor`'s per-token entries along `dim`, averaged per kept token (in float32)."""
        k = int(self.kept.shape[0])
        moved = tensor.movedim(dim, 0)
        members = self.group >= 0
        if bool(members.all()) and k == self.num_tokens:
            return tensor  # nothing merged or pruned: the very same values
        index = self.group[members].to(tensor.device)
        values = moved[members.to(tensor.device)].float()
        sums = torch.zeros((k, *values.shape[1:]), dtype=torch.float32, device=tensor.device)
        sums.index_add_(0, index, values)
        counts = torch.bincount(index, minlength=k).clamp(min=1).to(torch.float32)
        means = sums / counts.view(-1, *([1] * (values.dim() - 1)))
        return means.to(tensor.dtype).movedim(0, dim)


def plan_reduction(
    embeds: torch.Tensor, rows: list[int], prune_keep: float, merge_keep: float
) -> ReductionPlan:
    n = int(embeds.shape[0])
    runs = merge_runs(embeds, rows, merge_keep)
    run_of = torch.empty(n, dtype=torch.long)
    for i, (start, end) in enumerate(runs):
        run_of[start:end] = i
    if len(runs) == n:
        means = embeds
    else:
        counts = torch.tensor([end - start for start, end in runs], dtype=torch.float32)
        sums = torch.zeros((len(runs), embeds.shape[1]), dtype=torch.float32)
        sums.index_add_(0, run_of, embeds.detach().float().cpu())
        means = sums / counts.unsqueeze(1)
    chosen = select_tokens(means, prune_keep)  # indices into runs, ascending
    slot = torch.full((len(runs),), -1, dtype=torch.long)
    slot[chosen] = torch.arange(len(chosen))
    kept = torch.tensor([run_position(*runs[i]) for i in chosen.tolist()], dtype=torch.long)
    return ReductionPlan(
        num_tokens=n,
        kept=kept,
        group=slot[run_of],
        merged=n - len(runs),
        pruned=len(runs) - len(chosen),
    )


def plan_static(frames: list[torch.Tensor], drop_static: float) -> list[ReductionPlan]:
    """A window's frames (each (tokens, hidden), in order), each token kept only where it changed
    by `drop_static` or more (relative L2) since the window last showed that grid position; at
    least one token of a frame is kept (its most changed), so every frame stays in the prompt.
    A frame whose token count differs from the one before starts over (kept whole)."""
    plans: list[ReductionPlan] = []
    shown: torch.Tensor | None = None  # per position, the latest token the window showed
    for frame in frames:
        n = int(frame.shape[0])
        current = frame.detach().float().cpu()
        if shown is None or shown.shape != current.shape:
            changed = torch.ones(n, dtype=torch.bool)
            shown = current.clone()
        else:
            change = (current - shown).norm(dim=1) / shown.norm(dim=1).clamp(min=1e-6)
            changed = change >= drop_static
            if not bool(changed.any()):
                changed[int(change.argmax())] = True
            shown[changed] = current[changed]
        kept = changed.nonzero().flatten()
        group = torch.full((n,), -1, dtype=torch.long)
        group[kept] = torch.arange(len(kept))
        plans.append(ReductionPlan(num_tokens=n, kept=kept, group=group, merged=0, pruned=n - len(kept)))
    return plans


@dataclass(frozen=True)
class ReducedBatch:
    inputs: dict[str, Any]
    plans: list[list[ReductionPlan]]  # per row, one per image in prompt order
    columns: list[torch.Tensor]  # per row: the FULL batch's columns that stay (tests compare positions)
    full_positions: torch.Tensor  # (rows, batch, length) of the full batch

    @property
    def pruned(self) -> list[int]:
        return [sum(p.pruned for p in row) for row in self.plans]

    @property
    def merged(self) -> list[int]:
        return [sum(p.merged for p in row) for row in self.plans]


def reduce_batch(
    adapter: ReducibleModel,
    inputs: dict[str, Any],
    visuals: list[VisualTokens | tuple[VisualTokens, ...]],
    prune_keeps: list[float],
    merge_keeps: list[float],
    drop_statics: list[float] | None = None,
) -> ReducedBatch:
    """The adapter's full generation inputs (left-padded), each row's images merged and pruned
    (each on its own), or a row's window of frames without its static patches (`drop_statics`);
    positions given explicitly."""
    positions = adapter.prompt_positions(inputs)
    input_ids, attention = inputs["input_ids"], inputs["attention_mask"]
    device = input_ids.device
    plans: list[list[ReductionPlan]] = []
    columns: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    extras: list[dict[str, torch.Tensor]] = []
    statics = drop_statics or [0.0] * len(visuals)
    rows = zip(visuals, prune_keeps, merge_keeps, statics, strict=True)
    for row, (shown, prune_keep, merge_keep, drop_static) in enumerate(rows):
        images = shown if isinstance(shown, tuple) else (shown,)
        image_cols = (input_ids[row] == adapter.image_token_id).nonzero().flatten().cpu()
        if len(image_cols) != sum(v.num_tokens for v in images):
            total = sum(v.num_tokens for v in images)
            raise ValueError(f"row {row}: {len(image_cols)} image placeholders, {total} tokens")
        if len(images) > 1 and drop_static > 0:  # a window: its static patches dropped
            if prune_keep < 1.0 or merge_keep < 1.0:
                raise ValueError(f"row {row}: static patches dropped AND pruning or merging: one at a time")
            row_plans = plan_static([v.embeds for v in images], drop_static)
        else:  # each image merged and pruned on its own (a window's frame by frame)
            row_plans = [
                plan_reduction(v.embeds, adapter.token_rows(v), prune_keep, merge_keep) for v in images
            ]
        keep_col = attention[row].bool().cpu().clone()
        at = 0
        for visual, plan in zip(images, row_plans, strict=True):
            dropped = torch.ones(visual.num_tokens, dtype=torch.bool)
            dropped[plan.kept] = False
            keep_col[image_cols[at : at + visual.num_tokens][dropped]] = False
            at += visual.num_tokens
            embeds.append(plan.apply(visual.embeds.to(adapter.dtype)))
            extras.append({name: plan.apply(t.to(adapter.dtype), dim=1) for name, t in visual.extras.items()})
        columns.append(keep_col.nonzero().flatten())
        plans.append(row_plans)
    width = max(len(c) for c in columns)
    batch = len(visuals)
    per_column = {"input_ids": input_ids, **{k: inputs[k] for k in adapter.column_inputs}}
    rebuilt = {
        k: torch.full(
            (batch, width), adapter.tokenizer.pad_token_id if k == "input_ids" else 0, dtype=v.dtype
        )
        for k, v in per_column.items()
    }
    new_mask = torch.zeros((batch, width), dtype=attention.dtype)
    new_positions = torch.zeros((positions.shape[0], batch, width), dtype=positions.dtype)
    for row, cols in enumerate(columns):
        at = width - len(cols)  # left padding again
        for k, v in per_column.items():
            rebuilt[k][row, at:] = v[row, cols.to(v.device)].cpu()
        new_mask[row, at:] = 1
        new_positions[:, row, at:] = positions[:, row, cols.to(positions.device)].cpu()
    reduced = {
        **inputs,
        **{k: v.to(device) for k, v in rebuilt.items()},
        "attention_mask": new_mask.to(device),
        # Explicit positions: generate uses them for the prompt and continues at last + 1.
        "position_ids": adapter.positions_for_generate(new_positions.to(device)),
        "mm_encoder_outputs": adapter.mm_encoder_outputs(embeds, extras),
    }
    return ReducedBatch(reduced, plans, columns, positions)


def reduce_inputs(
    adapter: ReducibleModel,
    inputs: dict[str, Any],
    visuals: list[VisualTokens | tuple[VisualTokens, ...]],
    prune_keeps: list[float],
    merge_keeps: list[float],
    drop_statics: list[float] | None = None,
) -> tuple[dict[str, Any], list[int], list[int]]:
    """(inputs, tokens pruned per row (static patches included), tokens merged away per row)."""
    reduced = reduce_batch(adapter, inputs, visuals, prune_keeps, merge_keeps, drop_statics)
    return reduced.inputs, reduced.pruned, reduced.merged
