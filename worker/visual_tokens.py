"""Visual tokens of one image: the vision tower's merged embeddings plus the patch grid.

Stored as safetensors (never pickle), and validated against the model before anyone feeds
them to an engine: a wrong shape must be a cache miss, not a crashed generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT_VERSION = "1"


class InvalidVisualTokens(ValueError):
    pass


@dataclass(frozen=True)
class VisualTokens:
    embeds: torch.Tensor  # (tokens, hidden)
    grid_thw: torch.Tensor  # (1, 3) int64: temporal, height, width patches before merging

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    def to_bytes(self, fingerprint: str) -> bytes:
        tensors = {"embeds": self.embeds.contiguous().cpu(), "grid_thw": self.grid_thw.to(torch.int64).cpu()}
        meta = {"format": FORMAT_VERSION, "fingerprint": fingerprint}
        return save_safetensors(tensors, metadata={"visbatch": json.dumps(meta)})

    @classmethod
    def from_bytes(
        cls, data: bytes, *, fingerprint: str, hidden_size: int, merge_size: int, dtype: torch.dtype
    ) -> VisualTokens:
        """Parse and check an entry; raise InvalidVisualTokens on any mismatch."""
        try:
            tensors = load_safetensors(data)
        except Exception as exc:  # safetensors raises its own error types on corrupt bytes
            raise InvalidVisualTokens(f"unreadable cache entry: {exc}") from exc
        meta = _metadata(data)
        if meta.get("fingerprint") != fingerprint:
            raise InvalidVisualTokens("cache entry was made by another model or preprocessing")
        embeds, grid = tensors.get("embeds"), tensors.get("grid_thw")
        if embeds is None or grid is None:
            raise InvalidVisualTokens("cache entry lacks embeds or grid_thw")
        if grid.shape != (1, 3) or grid.dtype != torch.int64:
            raise InvalidVisualTokens(f"bad grid_thw {tuple(grid.shape)} {grid.dtype}")
        expected = int(grid.prod()) // (merge_size**2)
        if embeds.dim() != 2 or embeds.shape[0] != expected or embeds.shape[1] != hidden_size:
            raise InvalidVisualTokens(
                f"embeds {tuple(embeds.shape)} do not match grid {grid.tolist()} / hidden {hidden_size}"
            )
        if embeds.dtype != dtype:
            raise InvalidVisualTokens(f"embeds dtype {embeds.dtype}, model wants {dtype}")
        if not torch.isfinite(embeds).all():
            raise InvalidVisualTokens("embeds contain NaN or inf")
        return cls(embeds=embeds, grid_thw=grid)


def _metadata(data: bytes) -> dict:
    # safetensors header: 8-byte little-endian length, then JSON with "__metadata__".
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    raw = header.get("__metadata__", {}).get("visbatch", "{}")
    return json.loads(raw)
