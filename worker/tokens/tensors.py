"""Visual tokens of one image: the vision tower's output as the language model takes it.

* ``embeds`` (tokens, hidden): what goes in at the image-token positions;
* ``grid_thw`` (1, 3) int64: the image's layout in the family's own units, read by its adapter
  (Qwen: temporal, height, width patches before merging; Idefics3: 1, tile rows, tile columns);
* ``extras``: other per-token outputs of the tower that the language model needs, each
  (layers, tokens, width) (Qwen3-VL: ``deepstack``, the features its first decoder layers add).

Stored as safetensors (never pickle), optionally zstd-compressed (``compress=True``,
``VISBATCH_CACHE_COMPRESSION=zstd``): then the entry is ``VBZ1`` + one zstd frame of the same
safetensors bytes. A safetensors entry starts with its header's length (8 bytes, little-endian,
far below 2**32), never with ``VBZ1``, so both kinds read, whichever setting wrote them. Checked
against the model (``TokenSpec``, from the adapter) before anyone feeds them to an engine: a
wrong shape must be a cache miss, not a crashed generation. Format 2 added ``extras``; a
format-1 entry is a format-2 entry without them, so it still reads for families that need none
(and is refused for those that do).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

FORMAT_VERSION = "2"
# A compressed entry: this magic, then one zstd frame of the safetensors bytes (docs/scale.md,
# "The token cache at scale": bf16 entries measured 44-55% smaller, zstd level 1).
COMPRESSED_MAGIC = b"VBZ1"
ZSTD_LEVEL = 1
# A decompressed entry larger than this is refused unread (a frame claiming gigabytes is a bomb):
# the largest real entry, 16,384 tokens x 8,192 wide x 4 extra layers x 4 bytes, is 2 GiB.
MAX_ENTRY_BYTES = 4 * 1024**3
READABLE_VERSIONS = ("1", "2")
EXTRA_PREFIX = "extra."


class InvalidVisualTokens(ValueError):
    pass


@dataclass(frozen=True)
class TokenSpec:
    """What one model's visual tokens must look like (``ModelAdapter.token_spec``)."""

    hidden_size: int
    dtype: torch.dtype
    # Tokens a layout stands for; raises ValueError for a layout this model cannot produce.
    tokens_for_grid: Callable[[torch.Tensor], int]
    # name -> (layers, width) of each extra the model needs; no others are allowed.
    extras: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class VisualTokens:
    embeds: torch.Tensor  # (tokens, hidden)
    grid_thw: torch.Tensor  # (1, 3) int64: the layout, in the family's units (see module doc)
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)  # name -> (layers, tokens, width)

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    def to_bytes(self, fingerprint: str, *, compress: bool = False) -> bytes:
        tensors = {"embeds": self.embeds.contiguous().cpu(), "grid_thw": self.grid_thw.to(torch.int64).cpu()}
        for name, tensor in self.extras.items():
            tensors[EXTRA_PREFIX + name] = tensor.contiguous().cpu()
        meta = {"format": FORMAT_VERSION, "fingerprint": fingerprint}
        data = save_safetensors(tensors, metadata={"visbatch": json.dumps(meta)})
        return compress_entry(data) if compress else data

    def check(self, spec: TokenSpec) -> None:
        """Raise InvalidVisualTokens unless these tokens fit the model exactly."""
        embeds, grid = self.embeds, self.grid_thw
        if not isinstance(embeds, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise InvalidVisualTokens("visual tokens are not tensors")
        if tuple(grid.shape) != (1, 3) or grid.dtype not in (torch.int64, torch.int32):
            raise InvalidVisualTokens(f"bad grid_thw {tuple(grid.shape)} {grid.dtype}")
        try:
            expected = spec.tokens_for_grid(grid)
        except ValueError as exc:
            raise InvalidVisualTokens(f"grid_thw {grid.tolist()}: {exc}") from None
        if embeds.dim() != 2 or tuple(embeds.shape) != (expected, spec.hidden_size):
            raise InvalidVisualTokens(
                f"embeds {tuple(embeds.shape)} do not fit grid {grid.tolist()}: "
                f"the model wants ({expected}, {spec.hidden_size})"
            )
        if set(self.extras) != set(spec.extras):
            raise InvalidVisualTokens(
                f"extras {sorted(self.extras)} do not match the model's {sorted(spec.extras)}"
            )
        for name, (layers, width) in spec.extras.items():
            extra = self.extras[name]
            if not isinstance(extra, torch.Tensor) or tuple(extra.shape) != (layers, expected, width):
                shape = tuple(extra.shape) if isinstance(extra, torch.Tensor) else type(extra).__name__
                raise InvalidVisualTokens(
                    f"extra {name!r} {shape}, the model wants {(layers, expected, width)}"
                )
        for name, tensor in {"embeds": embeds, **self.extras}.items():
            if tensor.dtype != spec.dtype:
                raise InvalidVisualTokens(f"{name} dtype {tensor.dtype}, model wants {spec.dtype}")
            if not torch.isfinite(tensor).all():
                raise InvalidVisualTokens(f"{name} contain NaN or inf")

    @classmethod
    def from_bytes(cls, data: bytes, *, fingerprint: str, spec: TokenSpec) -> VisualTokens:
        """Parse and check an entry; raise InvalidVisualTokens on any mismatch."""
        try:
            data = decompress_entry(data)
            tensors = load_safetensors(data)
            meta = _metadata(data)
        except Exception as exc:  # safetensors raises its own error types on corrupt bytes
            raise InvalidVisualTokens(f"unreadable cache entry: {exc}") from exc
        if meta.get("format") not in READABLE_VERSIONS:
            raise InvalidVisualTokens(f"cache entry format {meta.get('format')!r} is not readable here")
        if meta.get("fingerprint") != fingerprint:
            raise InvalidVisualTokens("cache entry was made by another model or preprocessing")
        embeds, grid = tensors.pop("embeds", None), tensors.pop("grid_thw", None)
        if embeds is None or grid is None:
            raise InvalidVisualTokens("cache entry lacks embeds or grid_thw")
        extras = {k.removeprefix(EXTRA_PREFIX): v for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}
        if len(extras) != len(tensors):
            raise InvalidVisualTokens(f"cache entry has unknown tensors {sorted(tensors)}")
        tokens = cls(embeds=embeds, grid_thw=grid, extras=extras)
        if grid.dtype != torch.int64:
            raise InvalidVisualTokens(f"bad grid_thw {tuple(grid.shape)} {grid.dtype}")
        tokens.check(spec)
        return tokens


def compress_entry(data: bytes) -> bytes:
    import zstandard

    return COMPRESSED_MAGIC + zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def decompress_entry(data: bytes) -> bytes:
    """The safetensors bytes of an entry, compressed or not (ValueError when it cannot be read)."""
    if not data.startswith(COMPRESSED_MAGIC):
        return data
    import zstandard

    frame = data[len(COMPRESSED_MAGIC) :]
    size = zstandard.frame_content_size(frame)
    if size < 0 or size > MAX_ENTRY_BYTES:
        raise ValueError(f"compressed entry of unknown or excessive size ({size})")
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)


def _metadata(data: bytes) -> dict:
    # safetensors header: 8-byte little-endian length, then JSON with "__metadata__".
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    raw = header.get("__metadata__", {}).get("visbatch", "{}")
    return json.loads(raw)
