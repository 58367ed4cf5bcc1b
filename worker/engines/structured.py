"""JSON output constrained to a schema, with llguidance.

Why llguidance: it is what vLLM itself uses for structured outputs (one grammar semantics
across our two engines), it computes a token mask in tens of microseconds with no per-schema
compile step worth caching across processes, and it is maintained. Constraining is not trusted
alone: every output is parsed and validated with `jsonschema` afterwards, and one that fails is
recorded as an error on its request, never stored as a result. The schema checks and the output
validation are torch-free and live in ``ingest.schema``; this module adds the logits processor.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import LogitsProcessor

# The checks themselves live in a torch-free module, so that JobSpec can run them at every door.
from ingest.schema import SchemaError, check_schema, grammar_for, validate_output

__all__ = ["GrammarLogitsProcessor", "SchemaError", "check_schema", "validate_output"]


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks each row's logits to what its schema allows next; rows without a schema are untouched.

    transformers calls a logits processor once per step with all tokens so far, so the token
    chosen at the previous step is the last column: it is fed to that row's matcher first.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, schemas: list[dict[str, Any] | None]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        lltok = _lltokenizer(tokenizer, vocab_size)
        self.matchers = [
            None if s is None else llguidance.LLMatcher(lltok, grammar_for(json.dumps(s, sort_keys=True)))
            for s in schemas
        ]
        self.steps = 0
        words = (vocab_size + 31) // 32
        self.bitmask = torch.full((len(schemas), words), -1, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import llguidance.torch as llg_torch

        rows = [i for i, m in enumerate(self.matchers) if m is not None]
        if not rows:
            return scores
        if self.steps > 0:
            for i in rows:
                matcher = self.matchers[i]
                if not matcher.is_stopped() and not matcher.is_error():
                    matcher.consume_token(int(input_ids[i, -1]))
        self.steps += 1
        for i in rows:
            llg_torch.fill_next_token_bitmask(self.matchers[i], self.bitmask, i)
        # Unpack 32 bits per word ourselves: llguidance's helper needs torch.compile (a C compiler).
        allowed = ((self.bitmask[rows].unsqueeze(-1) >> self._bits) & 1).view(len(rows), -1)
        allowed = allowed[:, : scores.shape[1]].to(scores.device).bool()
        masked = scores[rows].masked_fill(~allowed, float("-inf"))
        scores[rows] = masked
        return scores


_LLTOKENIZERS: dict[tuple[int, int], Any] = {}


def _lltokenizer(tokenizer: Any, vocab_size: int) -> Any:
    # Building it serializes the whole tokenizer (~1 s on real vocabularies): once per process.
    key = (id(tokenizer), vocab_size)
    if key not in _LLTOKENIZERS:
        import llguidance.hf

        _LLTOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    return _LLTOKENIZERS[key]
