"""What the tiny random checkpoints of every family share (worker.models.tiny and the
tiny_<family> modules): a byte-level tokenizer with the family's special tokens and chat
template, the language model's part of the config, and a seeded random model written as
safetensors. Each family module keeps only what is its own: its specials, its template, its
tower and its processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def byte_level_tokenizer(
    special_tokens: list[str],
    chat_template: str,
    *,
    eos_token: str,
    pad_token: str = "<|endoftext|>",
    **extra: Any,
):
    """A byte-level BPE tokenizer with no merges: every byte is a token, plus `special_tokens`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        model_max_length=32768,
        **extra,
    )


def text_config(
    tokenizer: Any,
    *,
    hidden_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate_size: int | None,
    **extra: Any,
) -> dict[str, Any]:
    """The language model's sizes (intermediate twice the hidden size unless given), and `extra`
    (model_type, norms, rope, the special token ids)."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or hidden_size * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 32768,
        **extra,
    }


def save_random_model(model_class: Any, config: Any, out: Path, *, seed: int, **generation: int) -> None:
    """`model_class(config)` with weights drawn from `seed`, greedy generation with the ids in
    `generation` (eos_token_id, pad_token_id, ...), saved as safetensors into `out`."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config = GenerationConfig(**generation, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
