"""A tiny random Qwen2-VL that builds offline: what tests, the offline demo and benchmarks run.

Its weights are random, so its outputs are meaningless text; what it proves is that every
stage (processor, vision tower, token cache, embedding injection, packing, SQL) works with
the real transformers classes, without the model hub.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_README = """# visbatch tiny random Qwen2-VL

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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )


FAMILIES = ("qwen2_vl", "qwen2_5_vl")


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
    """A random Qwen2-VL config; the defaults are the tiny test model, the knobs size it up
    (benchmarks build a ~100M-parameter one on CPU: see bench/models.py)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (choose from {', '.join(FAMILIES)})")
    if hidden_size % heads or heads % kv_heads:
        raise ValueError("hidden_size must divide by heads, and heads by kv_heads")
    config_class = Qwen2VLConfig if family == "qwen2_vl" else Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden_size // heads
    # M-RoPE splits head_dim/2 rotary frequencies over (temporal, height, width).
    quarter = head_dim // 2 // 4
    mrope_section = [head_dim // 2 - 2 * quarter * 3 // 2, quarter * 3 // 2, quarter * 3 // 2]
    return config_class(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or hidden_size * 2,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": mrope_section,
                "rope_theta": 10000.0,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config=_vision_config(family, hidden_size, vision_depth, vision_embed_dim, vision_heads),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def write_tiny_model(
    out: Path,
    *,
    family: str = "qwen2_vl",
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    **knobs: int,
) -> Path:
    """Write a loadable tiny Qwen2-VL or Qwen2.5-VL (config, safetensors, tokenizer, processor) into `out`.

    `knobs` are tiny_config's other sizes (vision_depth, heads, kv_heads, intermediate_size,
    vision_embed_dim, vision_heads).
    """
    import torch
    import transformers
    from transformers import GenerationConfig, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    prefix = "Qwen2VL" if family == "qwen2_vl" else "Qwen2_5_VL"

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, family=family, hidden_size=hidden_size, layers=layers, **knobs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # Real Qwen2-VL defaults: 14 px patches merged 2x2, so one visual token covers 28x28 px.
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    video_processor = Qwen2VLVideoProcessor()
    processor = getattr(transformers, f"{prefix}Processor")(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / "README.md").write_text(TINY_README)
    (out / "visbatch_tiny.json").write_text(
        json.dumps({"family": family, "seed": seed, "random_weights": True})
    )
    return out
