"""Tiny random VLMs that build offline: what tests, the offline demo and benchmarks run.

One per supported family: Qwen2-VL (the default), Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE,
Idefics3 (worker.models.tiny_idefics3), InternVL (worker.models.tiny_internvl) and
LLaVA-OneVision (worker.models.tiny_llava_onevision). Their weights are random, so their
outputs are meaningless text; what they prove is that every stage (processor, vision tower,
token cache, embedding injection, packing, SQL) works with the real transformers classes,
without the hub.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.models.tiny_parts import byte_level_tokenizer, save_random_model, text_config

TINY_README = """# visbatch tiny random {family}

Built offline by `visbatch model tiny` from a config: RANDOM weights.
Its outputs are meaningless; it exists to exercise the pipeline without the model hub.
"""

# Qwen's special tokens, in the order (and so with the ids) our byte-level vocab gives them.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL chat template, reduced to what visbatch sends (system/user text and images).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is a token, plus Qwen's specials."""
    return byte_level_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>")


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "idefics3", "internvl")
FAMILIES += ("llava_onevision",)  # worker.models.tiny_llava_onevision
QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
# transformers class-name prefix per Qwen family.
CLASS_PREFIX = {
    "qwen2_vl": "Qwen2VL",
    "qwen2_5_vl": "Qwen2_5_VL",
    "qwen3_vl": "Qwen3VL",
    "qwen3_vl_moe": "Qwen3VLMoe",
}


def normalize_family(name: str) -> str:
    """`qwen3-vl`, `Qwen3_VL`, `qwen2.5-vl` -> the model_type spelling (`qwen3_vl`, `qwen2_5_vl`)."""
    family = name.strip().lower().replace("-", "_").replace(".", "_")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {name!r} (choose from {', '.join(FAMILIES)})")
    return family


def _vision_config(family: str, hidden_size: int, depth: int, embed_dim: int = 64, heads: int = 2) -> dict:
    common = {
        "depth": depth,
        "num_heads": heads,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if family == "qwen2_vl":
        return {**common, "embed_dim": embed_dim, "hidden_size": hidden_size, "mlp_ratio": 2}
    if family in QWEN3_FAMILIES:
        # Qwen3-VL: 16-px patches, a learned position grid resampled to each image, and
        # "deepstack": features of early tower blocks added to the first decoder layers.
        return {
            **common,
            "patch_size": 16,
            "hidden_size": embed_dim,
            "intermediate_size": 2 * embed_dim,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": list(range(min(3, depth))),
        }
    # Qwen2.5-VL: windowed attention (112 px windows) except in the full-attention blocks,
    # and the merger projects to the LM width (out_hidden_size).
    return {
        **common,
        "hidden_size": embed_dim,
        "intermediate_size": 2 * embed_dim,
        "out_hidden_size": hidden_size,
        "window_size": 112,
        "fullatt_block_indexes": [depth - 1],
    }


def _rope_parameters(family: str, head_dim: int) -> dict:
    half = head_dim // 2  # M-RoPE splits head_dim/2 rotary frequencies over (temporal, height, width)
    if family in QWEN3_FAMILIES:
        # Qwen3-VL's own proportions (24, 20, 20 of 64), interleaved over the frequencies.
        side = half * 5 // 16
        section = [half - 2 * side, side, side]
        return {
            "rope_type": "default",
            "mrope_section": section,
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
        }
    quarter = half // 4
    section = [half - 2 * quarter * 3 // 2, quarter * 3 // 2, quarter * 3 // 2]
    return {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}


def tiny_config(
    tokenizer,
    *,
    family: str = "qwen2_vl",
    hidden_size: int = 128,
    layers: int = 2,
    vision_depth: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate_size: int | None = None,
    vision_embed_dim: int = 64,
    vision_heads: int = 2,
):
    """A random Qwen-VL config; the defaults are the tiny test model, the knobs size it up
    (benchmarks build a ~100M-parameter one on CPU: see bench/models.py)."""
    import transformers

    family = normalize_family(family)
    if family not in CLASS_PREFIX:
        raise ValueError(f"{family} is not a Qwen-VL family (see worker.models.tiny_idefics3)")
    if hidden_size % heads or heads % kv_heads:
        raise ValueError("hidden_size must divide by heads, and heads by kv_heads")
    config_class = getattr(transformers, f"{CLASS_PREFIX[family]}Config")

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden_size // heads
    text = text_config(
        tokenizer,
        hidden_size=hidden_size,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        rope_parameters=_rope_parameters(family, head_dim),
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if family in QWEN3_FAMILIES:
        text["head_dim"] = head_dim
    if family == "qwen3_vl_moe":
        # Four small experts, two per token: the routing runs for real, the model stays tiny.
        # norm_topk_prob as the released checkpoints set it (transformers always renormalizes the
        # top-k weights; vLLM reads the flag). The expert width is neither hidden nor hidden/2, so
        # no expert matrix is square (see _experts_as_published).
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size * 3 // 8,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    return config_class(
        text_config=text,
        vision_config=_vision_config(family, hidden_size, vision_depth, vision_embed_dim, vision_heads),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _qwen_processor(family: str, tokenizer):
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    if family in QWEN3_FAMILIES:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        # Qwen3-VL's own processor defaults: 16-px patches merged 2x2 (32x32 px per token), mean
        # and std 0.5, at least 65,536 px; at most 1280 tokens, like the Qwen2-VL tiny model.
        image_processor = Qwen2VLImageProcessor(
            patch_size=16,
            merge_size=2,
            size={"shortest_edge": 65536, "longest_edge": 32 * 32 * 1280},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
        video_processor = Qwen3VLVideoProcessor()
        processor_class = transformers.Qwen3VLProcessor
    else:
        # Real Qwen2-VL defaults: 14 px patches merged 2x2, so one visual token covers 28x28 px.
        image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        video_processor = Qwen2VLVideoProcessor()
        processor_class = getattr(transformers, f"{CLASS_PREFIX[family]}Processor")
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _experts_as_published(out: Path) -> None:
    """Store Qwen3-VL-MoE's fused expert weights the way the released checkpoints do.

    transformers 5 saves them in its in-memory layout, (experts, 2 x moe width, hidden); the hub
    checkpoints hold (experts, hidden, 2 x moe width), which transformers transposes on load (by
    shape: hence no square expert matrix in the tiny config) and vLLM reads as is.
    """
    from safetensors.torch import load_file, save_file

    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        for key in [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})


def write_tiny_model(
    out: Path,
    *,
    family: str = "qwen2_vl",
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    **knobs: int,
) -> Path:
    """Write a loadable tiny random model of `family` (config, safetensors, tokenizer, processor) into `out`.

    `family` takes the model_type (`qwen3_vl`) or the usual spelling (`qwen3-vl`). `knobs` are
    tiny_config's other sizes (vision_depth, heads, kv_heads, intermediate_size,
    vision_embed_dim, vision_heads).
    """
    import transformers

    family = normalize_family(family)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if family == "idefics3":
        from worker.models.tiny_idefics3 import write_tiny_idefics3

        write_tiny_idefics3(out, seed=seed, hidden_size=hidden_size, layers=layers, **knobs)
    elif family == "internvl":
        from worker.models.tiny_internvl import write_tiny_internvl

        write_tiny_internvl(out, seed=seed, hidden_size=hidden_size, layers=layers, **knobs)
    elif family == "llava_onevision":
        from worker.models.tiny_llava_onevision import write_tiny_llava_onevision

        write_tiny_llava_onevision(out, seed=seed, hidden_size=hidden_size, layers=layers, **knobs)
    else:
        tokenizer = build_tokenizer()
        config = tiny_config(tokenizer, family=family, hidden_size=hidden_size, layers=layers, **knobs)
        save_random_model(
            getattr(transformers, f"{CLASS_PREFIX[family]}ForConditionalGeneration"),
            config,
            out,
            seed=seed,
            eos_token_id=config.text_config.eos_token_id,
            pad_token_id=config.text_config.pad_token_id,
        )
        if family == "qwen3_vl_moe":
            _experts_as_published(out)
        _qwen_processor(family, tokenizer).save_pretrained(out)
    (out / "README.md").write_text(TINY_README.format(family=family))
    (out / "visbatch_tiny.json").write_text(
        json.dumps({"family": family, "seed": seed, "random_weights": True})
    )
    return out
