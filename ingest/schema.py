"""A job's JSON schema: bounded, valid, compilable to a grammar; and outputs checked against it.

Torch-free on purpose: ``JobSpec`` runs ``check_schema`` itself, so every door that makes a spec
(``visbatch run/submit/plan --schema``, a drop folder's ``_spec.json``, ``JobSpec(...)`` in Python)
gets the same checks and the same messages, without loading torch. The engines import what
they need from here (``worker.engines.structured`` builds the logits processor on top).

The order of the checks matters: depth first, counted without recursion, so that a 5,000-deep
document is a clean limit error instead of a ``RecursionError`` in ``json.dumps`` or in
jsonschema's own recursive walk; then size; then the JSON-schema meta-schema; then the grammar
compiler that constrains decoding (llguidance, the backend vLLM uses too).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32


class SchemaError(ValueError):
    """The job's JSON schema is not usable (too big, too deep, invalid, or not compilable)."""


class JSONTooDeep(ValueError):
    """A JSON document nested deeper than Python's parser can follow (about 1,000 levels)."""


def json_depth(node: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0, ``{}`` and ``[]`` are 1), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(node, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, list | tuple):
            children = list(value)
        else:
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads_json(raw: str | bytes, what: str = "the document") -> Any:
    """``json.loads`` with messages for people: a syntax error says where, and a document nested
    too deeply for Python's parser is a ``ValueError`` like any other bad input, not a crash."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ValueError(f"{what} is not valid JSON ({exc.msg} at {where})") from None
    except RecursionError:
        limit = f"a JSON schema: {MAX_SCHEMA_DEPTH} levels at most"
        raise JSONTooDeep(f"{what} is nested too deeply to read ({limit})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def check_schema(schema: Any) -> None:
    """Raise SchemaError unless ``schema`` is a JSON schema visbatch can constrain decoding with."""
    if not isinstance(schema, dict):
        raise SchemaError("the JSON schema must be a JSON object")
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        canonical = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:  # Python callers can pass sets, NaN...
        raise SchemaError(f"the JSON schema is not plain JSON ({exc})") from None
    if len(canonical.encode()) > MAX_SCHEMA_BYTES:
        raise SchemaError(f"the JSON schema is over {MAX_SCHEMA_BYTES} bytes")
    _check_canonical(canonical)


@lru_cache(maxsize=256)
def _check_canonical(canonical: str) -> None:
    # Cached: every task rebuilds its job's spec from the job row, and with it this check.
    import jsonschema
    import llguidance

    schema = json.loads(canonical)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"invalid JSON schema: {exc.message}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_for(canonical))
    if is_error:
        first = messages[0] if messages else "rejected by the grammar compiler"
        raise SchemaError(f"JSON schema not supported for constrained decoding: {first}")


@lru_cache(maxsize=64)
def grammar_for(schema_json: str) -> str:
    """The llguidance grammar of a schema given as JSON text (sorted keys: one cache entry per schema)."""
    import llguidance

    # Compact output: whitespace the model could emit forever is not allowed between tokens.
    return llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_flexible": False})


def validate_output(text: str, schema: dict[str, Any]) -> tuple[Any | None, str | None]:
    """(parsed JSON, None) when `text` is valid for `schema`, else (None, reason)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"output is not valid JSON ({exc.msg} at char {exc.pos})"
    except RecursionError:
        return None, "output is nested too deeply to read"
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: e.path)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
        return None, f"output does not match the schema at {where}: {errors[0].message}"
    return value, None
