"""JSON output constrained to a schema, with llguidance.

Why llguidance: it is what vLLM itself uses for structured outputs (one grammar semantics
across our two engines), it computes a token mask in tens of microseconds with no per-schema
compile step worth caching across processes, and it is maintained. Constraining is not trusted
alone: every output is parsed and validated with `jsonschema` afterwards, and one that fails is
recorded as an error on its request, never stored as a result.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jsonschema
import torch
from transformers import LogitsProcessor


class SchemaError(ValueError):
    """The job's JSON schema is not usable (invalid, or not supported by the grammar compiler)."""


def check_schema(schema: dict[str, Any]) -> None:
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"invalid JSON schema: {exc.message}") from exc
    import llguidance

    grammar = _grammar(json.dumps(schema, sort_keys=True))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(f"JSON schema not supported for constrained decoding: {messages[0]}")


@lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    import llguidance

    # Compact output: whitespace the model could emit forever is not allowed between tokens.
    return llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_flexible": False})


def validate_output(text: str, schema: dict[str, Any]) -> tuple[Any | None, str | None]:
    """(parsed JSON, None) when `text` is valid for `schema`, else (None, reason)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"output is not valid JSON ({exc.msg} at char {exc.pos})"
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: e.path)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
        return None, f"output does not match the schema at {where}: {errors[0].message}"
    return value, None


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
            None if s is None else llguidance.LLMatcher(lltok, _grammar(json.dumps(s, sort_keys=True)))
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
