"""Pack generation requests into batches by token count.

A batch costs what its longest row costs, times its rows (everything is padded to the
longest prompt, and every row holds KV cache for max_new_tokens). Sorting by length before
filling makes neighbours alike, so padding stays small; ties keep requests on the same image
together, so an engine with a prefix cache sees the same image back to back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PackItem(Generic[T]):
    payload: T
    input_tokens: int  # visual + prompt tokens
    max_new_tokens: int
    group: Hashable = None  # requests of different groups (sampling settings) never share a batch
    affinity: str = ""  # e.g. the image's cache key: equal values stay adjacent


@dataclass
class Batch(Generic[T]):
    items: list[PackItem[T]] = field(default_factory=list)

    @property
    def longest(self) -> int:
        return max((i.input_tokens for i in self.items), default=0)

    @property
    def cost(self) -> int:
        """Tokens the batch occupies: rows x (longest prompt + longest generation)."""
        new = max((i.max_new_tokens for i in self.items), default=0)
        return len(self.items) * (self.longest + new)

    @property
    def real_input_tokens(self) -> int:
        return sum(i.input_tokens for i in self.items)

    @property
    def padded_input_tokens(self) -> int:
        return len(self.items) * self.longest


def _fits(batch: Batch, item: PackItem, batch_tokens: int, max_batch_size: int, max_padding: float) -> bool:
    if len(batch.items) >= max_batch_size:
        return False
    longest = max(batch.longest, item.input_tokens)
    new = max([i.max_new_tokens for i in batch.items] + [item.max_new_tokens])
    if (len(batch.items) + 1) * (longest + new) > batch_tokens:
        return False
    # A long request joining short ones pads them all: better start a new batch.
    padded = (len(batch.items) + 1) * longest
    return 1.0 - (batch.real_input_tokens + item.input_tokens) / padded <= max_padding


def pack_by_tokens(
    items: Iterable[PackItem[T]],
    *,
    batch_tokens: int,
    max_batch_size: int,
    bucket: int = 32,
    max_padding: float = 0.1,
) -> list[Batch[T]]:
    """Greedy fill in length order. A request larger than the budget alone gets a batch of its own;
    a request that would make over `max_padding` of its batch padding starts a new one.

    Lengths are compared in buckets of `bucket` tokens first, so prompts of nearly equal length
    over the same image sort together (prefix sharing) at the price of under `bucket` pads a row.
    """
    if batch_tokens < 1 or max_batch_size < 1:
        raise ValueError("batch_tokens and max_batch_size must be positive")
    ordered = sorted(
        items, key=lambda i: (str(i.group), i.input_tokens // bucket, i.affinity, i.input_tokens)
    )
    batches: list[Batch[T]] = []
    current: Batch[T] = Batch()
    for item in ordered:
        same_group = not current.items or current.items[0].group == item.group
        if current.items and (
            not same_group or not _fits(current, item, batch_tokens, max_batch_size, max_padding)
        ):
            batches.append(current)
            current = Batch()
        current.items.append(item)
    if current.items:
        batches.append(current)
    return batches


def padding_waste(batches: Iterable[Batch]) -> float:
    """Share of input token slots that are padding (0.0 = none)."""
    batches = list(batches)
    padded = sum(b.padded_input_tokens for b in batches)
    if padded == 0:
        return 0.0
    return 1.0 - sum(b.real_input_tokens for b in batches) / padded
