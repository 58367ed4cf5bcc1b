"""How many visual tokens an image becomes, per model family, from the model's small JSON files.

Counting visual tokens is arithmetic on the processor's resize rule: ingest needs it for every
page and frame (to pack generation batches before any GPU work, and to enforce the token
budget), and the planner for every source it surveys. Neither may pay for torch and
transformers (seconds and most of a gigabyte per process), so the rule is computed here from
``config.json`` (the family) and ``preprocessor_config.json`` (patch and merge sizes, pixel
bounds) alone: a local folder, or just those files from the hub, cached by huggingface_hub.

The rule is exact, not an estimate: ``tests/test_token_rule.py`` checks it against the real
processor for random sizes, for every supported family.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ingest.budget import PixelBounds, TokenGeometry

# Model types whose image processor resizes with Qwen2-VL's smart_resize (patch x merge grid).
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Qwen2-VL's own defaults, used where a processor file leaves a value out.
DEFAULT_PATCH_SIZE = 14
DEFAULT_MERGE_SIZE = 2
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


class ModelFilesUnavailable(FileNotFoundError):
    """The model's config files cannot be read (no such folder, or the hub is unreachable)."""


class UnsupportedModel(ValueError):
    """The model's family has no token rule (and no adapter) in visbatch."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule, as transformers implements it: both sides a multiple of `factor`,
    the area within [min_pixels, max_pixels], the aspect ratio kept as closely as possible.

    Raises ValueError for aspect ratios over 200, like the processor.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class TokenRule:
    """One model's token rule: a grid of (patch x merge)-px cells, one visual token per cell."""

    family: str
    patch_size: int
    merge_size: int
    default: PixelBounds  # the processor's own resize bounds

    @property
    def factor(self) -> int:
        """Pixels per side of one visual token (Qwen2-VL: 14 x 2 = 28)."""
        return self.patch_size * self.merge_size

    @property
    def token_geometry(self) -> TokenGeometry:
        return TokenGeometry(token_pixels=self.factor * self.factor, default=self.default)

    def resized(self, width: int, height: int, bounds: PixelBounds | None = None) -> tuple[int, int]:
        """(width, height) the processor resizes an image to; ValueError for aspect ratios over 200."""
        b = bounds or self.default
        h, w = smart_resize(height, width, self.factor, b.min_pixels, b.max_pixels)
        return w, h

    def visual_tokens(self, width: int, height: int, bounds: PixelBounds | None = None) -> int:
        """Visual tokens of a `width` x `height` image resized within `bounds` (None: the model's)."""
        w, h = self.resized(width, height, bounds)
        return (w // self.factor) * (h // self.factor)

    @classmethod
    def from_files(cls, config: dict[str, Any], processor: dict[str, Any]) -> TokenRule:
        """From the parsed config.json and preprocessor_config.json (or processor_config.json)."""
        family = str(config.get("model_type", ""))
        if family not in QWEN_FAMILIES:
            raise UnsupportedModel(
                f"model type {family!r} is not supported (supported: {', '.join(QWEN_FAMILIES)})"
            )
        data = processor.get("image_processor", processor)
        size = data.get("size") or {}
        low = data.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
        high = data.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
        return cls(
            family=family,
            patch_size=int(data.get("patch_size") or DEFAULT_PATCH_SIZE),
            merge_size=int(data.get("merge_size") or DEFAULT_MERGE_SIZE),
            default=PixelBounds(int(low), int(high)),
        )


def model_file(model: str, name: str, revision: str | None = None) -> Path | None:
    """A small file of the model: from its folder, or from the hub (cached; never weights).

    None when the model does not have that file. Raises ModelFilesUnavailable when the model
    cannot be reached at all (no such folder, or a hub id while the hub is unreachable).
    """
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelFilesUnavailable(f"no model folder {model!r}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    # LocalEntryNotFoundError (not cached, or the hub unreachable) subclasses EntryNotFoundError
    # (the file does not exist) in huggingface_hub 1.x: it must be caught first.
    try:  # the cache first: no network round trip for a model used before
        return Path(hf_hub_download(model, name, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except EntryNotFoundError:
        return None
    except Exception:  # noqa: S110 - a corrupt cache entry: ask the hub below
        pass
    try:
        return Path(hf_hub_download(model, name, revision=revision, etag_timeout=5))
    except LocalEntryNotFoundError as exc:
        raise _unreachable(model, name, exc) from exc
    except EntryNotFoundError:
        return None
    except Exception as exc:
        raise _unreachable(model, name, exc) from exc


def _unreachable(model: str, name: str, exc: Exception) -> ModelFilesUnavailable:
    return ModelFilesUnavailable(
        f"cannot read {name} of model {model!r} ({type(exc).__name__}); "
        "is the model hub reachable? Give a local model folder with --model (or VISBATCH_MODEL)"
    )


def read_json_file(model: str, name: str, revision: str | None = None) -> dict[str, Any] | None:
    path = model_file(model, name, revision)
    return None if path is None else json.loads(path.read_text())


@lru_cache(maxsize=16)
def load_token_rule(model: str, revision: str | None = None) -> TokenRule:
    """The token rule of `model` (hub id or folder) from its config and processor files."""
    config = read_json_file(model, "config.json", revision)
    if config is None:
        raise ModelFilesUnavailable(f"model {model!r} has no config.json")
    for name in PROCESSOR_FILES:
        processor = read_json_file(model, name, revision)
        if processor is not None:
            return TokenRule.from_files(config, processor)
    raise ModelFilesUnavailable(f"model {model!r} has no {' or '.join(PROCESSOR_FILES)}")
