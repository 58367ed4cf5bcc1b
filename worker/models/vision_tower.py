"""Loading only a VLM's vision tower, for encode workers that run beside vLLM.

With the vLLM engine the language model lives in vLLM; loading the whole VLM again through
transformers just to encode images would hold a second copy of the LM weights on the GPU.
The tower is built from the config and only its weights are read from the safetensors files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# Checkpoints name the tower "visual." (as published) or "model.visual." (transformers 5 layout).
TOWER_PREFIXES = ("model.visual.", "visual.")


def weight_files(source: str, revision: str | None) -> list[Path]:
    folder = Path(source)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(source, revision=revision, allow_patterns=["*.safetensors", "*.json"])
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    return files


def tower_state_dict(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                prefix = next((p for p in TOWER_PREFIXES if key.startswith(p)), None)
                if prefix is not None:
                    state[key[len(prefix) :]] = handle.get_tensor(key).to(dtype)
    return state


def load_vision_tower(
    tower_class: Any,
    vision_config: Any,
    source: str,
    revision: str | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.nn.Module:
    state = tower_state_dict(weight_files(source, revision), dtype)
    if not state:
        raise ValueError(f"no vision-tower weights (keys starting with {TOWER_PREFIXES}) in {source}")
    # Built on the CPU (its computed buffers, e.g. rotary frequencies, are not in the checkpoint),
    # then the checkpoint's weights replace the random ones: strict, so nothing is left random.
    tower = tower_class._from_config(vision_config, dtype=dtype)
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.to(device).eval()
