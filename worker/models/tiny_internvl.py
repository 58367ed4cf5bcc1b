"""A tiny random InternVL (InternVL3 / 3.5 in transformers' own layout, `model_type` "internvl").

Laid out as the converted hub checkpoints (OpenGVLab/InternVL3-1B-hf) are: an InternViT tower,
pixel shuffle (downsample_ratio 0.5: 2x2 patches -> 1 token) and an MLP projector, a Qwen2
language model; GotOcr2ImageProcessor with dynamic tiling (min_patches 1, max_patches 12; the
processor turns crop_to_patches on at call time, as the hub files leave it off), InternVLProcessor
with `<img>` / `<IMG_CONTEXT>` / `</img>` and the converted checkpoints' chat template.

Scaled down: 224-px tiles of 14-px patches (16x16 patches, pixel-shuffled to 8x8 = 64 tokens per
tile; the real models: 448-px tiles, 256 tokens), so one token still covers 28x28 px and the
detail presets cap tiles here as they do for the real models (in slots of a quarter of theirs).
Random weights: the outputs are meaningless; it exists so that the adapter, its token rule and
the cached-token path run on the real transformers classes without the model hub.
"""

from __future__ import annotations

from pathlib import Path

from worker.models.tiny_parts import byte_level_tokenizer, save_random_model, text_config

TILE = 224
PATCH = 14
DOWNSAMPLE_RATIO = 0.5
IMAGE_SEQ_LENGTH = int((TILE // PATCH) ** 2 * DOWNSAMPLE_RATIO**2)
MAX_PATCHES = 12

# Qwen2's specials first, then InternVL's image markers (the converted tokenizers add these).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
]
# What InternVLProcessor reads from the tokenizer (tokenizer.start_image_token, ...).
EXTRA_SPECIAL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# The chat template transformers' conversion script gives the InternVL3 / 3.5 checkpoints.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    """Byte-level tokens plus Qwen2's turn markers and InternVL's image markers."""
    return byte_level_tokenizer(
        SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<|im_end|>", extra_special_tokens=EXTRA_SPECIAL_TOKENS
    )


def write_tiny_internvl(
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
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
    )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = InternVLConfig(
        text_config=text_config(
            tokenizer,
            hidden_size=hidden_size,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate_size=intermediate_size,
            model_type="qwen2",
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config={
            "hidden_size": vision_embed_dim,
            "intermediate_size": 2 * vision_embed_dim,
            "num_hidden_layers": vision_depth,
            "num_attention_heads": vision_heads,
            "image_size": [TILE, TILE],
            "patch_size": [PATCH, PATCH],
            "use_absolute_position_embeddings": True,
            "use_mean_pooling": True,
            "norm_type": "layer_norm",
        },
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=IMAGE_SEQ_LENGTH,
        downsample_ratio=DOWNSAMPLE_RATIO,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    save_random_model(
        InternVLForConditionalGeneration,
        config,
        out,
        seed=seed,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    # The hub's InternVL3 files: crop_to_patches is left False here; InternVLProcessor turns it on
    # for every call (its own defaults), which is what the token rule counts.
    image_processor = GotOcr2ImageProcessor(
        size={"height": TILE, "width": TILE},
        min_patches=1,
        max_patches=MAX_PATCHES,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        do_convert_rgb=True,
    )
    video_processor = InternVLVideoProcessor(
        size={"height": TILE, "width": TILE},
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    processor = InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        image_seq_length=IMAGE_SEQ_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
