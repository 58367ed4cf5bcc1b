"""A tiny random LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*-ov-hf) that builds offline.

Laid out like llava-onevision-qwen2-0.5b-ov-hf, shrunk: a SigLIP tower over square tiles (here
98-px tiles of 14-px patches: 7x7 = 49 tokens per tile; the real model: 384-px tiles, 27x27 =
729), a two-layer MLP projector, AnyRes over ``image_grid_pinpoints`` (every a x b grid of tiles
up to 6 x 6, as published), ``vision_aspect_ratio`` ``anyres_max_9`` (the unpadded grid is
interpolated down to about 9 tiles' worth), ``vision_feature_select_strategy`` ``full`` with the
last layer, the learned ``image_newline`` after every feature row, and a Qwen2 language model
with the published chat template. Random weights: the outputs are meaningless; it exists so that
the adapter, its token rule and the cached-token path run on the real transformers classes
without the model hub.
"""

from __future__ import annotations

from pathlib import Path

from worker.models.tiny_parts import byte_level_tokenizer, save_random_model, text_config

TILE = 98
PATCH = 14
TOKENS_PER_TILE = (TILE // PATCH) ** 2
MAX_GRID = 6  # tiles per side, as in the published image_grid_pinpoints
PINPOINTS = [[TILE * a, TILE * b] for a in range(1, MAX_GRID + 1) for b in range(1, MAX_GRID + 1)]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]

# The chat template llava-hf publishes for the OneVision Qwen2 models (images first, then text).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{# Render all video then #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer():
    """Byte-level tokens plus Qwen2's turn markers and OneVision's <image> and <video>."""
    return byte_level_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>")


def write_tiny_llava_onevision(
    out: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate_size: int | None = None,
    vision_depth: int = 2,
    vision_embed_dim: int = 64,
    vision_heads: int = 2,
) -> None:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlavaOnevisionConfig(
        text_config=text_config(
            tokenizer,
            hidden_size=hidden_size,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate_size=intermediate_size,
            model_type="qwen2",
            rms_norm_eps=1e-6,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": vision_embed_dim,
            "intermediate_size": 2 * vision_embed_dim,
            "num_hidden_layers": vision_depth,
            "num_attention_heads": vision_heads,
            "image_size": TILE,
            "patch_size": PATCH,
            "vision_use_head": False,
        },
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    save_random_model(
        LlavaOnevisionForConditionalGeneration,
        config,
        out,
        seed=seed,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video_processor = LlavaOnevisionVideoProcessor(
        size={"height": TILE, "width": TILE}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        num_image_tokens=TOKENS_PER_TILE,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
