"""Random Qwen2-VL models for the benchmarks, built offline once and cached under bench/.cache/models.

`tiny`     the test suite's model (2-layer LM, 2-block tower): stage overheads, not compute.
`vision`   tiny LM, a 2-block 128-wide tower (2x the test model's): the encode stage does real work.
`lm100m`   ~100M-parameter LM (768 wide, 12 layers, 12 heads, 2 KV heads) with that tower:
           on CPU, compute dominates generation the way a real model does on a GPU (packing, fleet).
`tiny-<family>`, `lm100m-<family>`  the same LMs in another family (llava_onevision, internvl, idefics3),
           with that family's tiny tower.
The real Qwen2-VL-2B tower (32 blocks, 1280 wide) costs well over 50x this one per image, so
every cache-hit ratio measured here is a lower bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.media import cache_dir

TOWER = {"vision_depth": 2, "vision_embed_dim": 128, "vision_heads": 2}
# The families vLLM takes through visbatch's plugin (worker/engines/vllm_models.py).
PLUGIN_FAMILIES = ("llava_onevision", "internvl", "idefics3")
LM100M = {"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 2, "intermediate_size": 3072}
SPECS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "vision": {**TOWER},
    "lm100m": {**LM100M, **TOWER},
    # The plugin families' (vLLM's Q12, bench/vllm_window.py): each with its own tiny tower.
    **{f"tiny-{family}": {"family": family} for family in PLUGIN_FAMILIES},
    **{f"lm100m-{family}": {"family": family, **LM100M} for family in PLUGIN_FAMILIES},
}


def bench_model(name: str) -> Path:
    """The folder of model `name` (see SPECS), written on first use."""
    from worker.models.tiny import write_tiny_model

    spec = SPECS[name]
    folder = cache_dir("models") / name
    marker = folder / "bench-spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return folder
    write_tiny_model(folder, **spec)
    marker.write_text(json.dumps(spec))
    return folder


def parameter_count(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                total += _numel(handle, key)
    return total


def _numel(handle, key: str) -> int:
    n = 1
    for dim in handle.get_slice(key).get_shape():
        n *= dim
    return n
