"""A tiny random Idefics3 (the architecture of SmolDocling and granite-docling) that builds offline.

Scaled like granite-docling-258M: tiles of (tile / patch)^2 patches pixel-shuffled by 2x2 (here
128-px tiles of 16-px patches: 16 tokens per tile; granite-docling: 512-px tiles, 64 tokens), the
image's longest side scaled to 4 tiles, a Llama language model. Random weights: the outputs are
meaningless; it exists so that the adapter, its token rule and the cached-token path run on the
real transformers classes without the model hub.
"""

from __future__ import annotations

from pathlib import Path

from worker.models.tiny_parts import byte_level_tokenizer, save_random_model, text_config

TILE = 128
PATCH = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
]

# Idefics3's chat template (as SmolVLM and granite-docling ship it).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build_tokenizer():
    """Byte-level tokens plus Idefics3's image, tile and turn markers."""
    return byte_level_tokenizer(
        SPECIAL_TOKENS, CHAT_TEMPLATE, eos_token="<end_of_utterance>", bos_token="<|im_start|>"
    )


def write_tiny_idefics3(
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
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Idefics3Config(
        text_config=text_config(
            tokenizer,
            hidden_size=hidden_size,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            intermediate_size=intermediate_size,
            model_type="llama",
            rms_norm_eps=1e-5,
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<end_of_utterance>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config={
            "hidden_size": vision_embed_dim,
            "intermediate_size": 2 * vision_embed_dim,
            "num_hidden_layers": vision_depth,
            "num_attention_heads": vision_heads,
            "image_size": TILE,
            "patch_size": PATCH,
        },
        scale_factor=SCALE_FACTOR,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    save_random_model(
        Idefics3ForConditionalGeneration,
        config,
        out,
        seed=seed,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 4 * TILE},
        max_image_size={"longest_edge": TILE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
