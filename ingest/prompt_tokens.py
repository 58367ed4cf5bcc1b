"""How many tokens a prompt costs (chat template included), from the model's tokenizer files alone.

`visbatch plan` prices a job before anything runs; it must not load torch and transformers (seconds
and most of a gigabyte) to count a few dozen tokens. The chat template is rendered with Jinja the
way transformers renders it (a sandbox, trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`) and the text is tokenized with the `tokenizers` library from tokenizer.json,
so the count is the one a run records: the prompt's tokens with the image's placeholder left out.
`tests/test_planner.py` checks it against every supported family's adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ingest.token_rules import model_file, read_json_file

# Files that may hold a chat template, in the order transformers prefers them.
_TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "tokenizer_config.json",
)
# What a family's template puts where the image goes (its placeholder tokens are left out).
_IMAGE_MARKERS = ("<|image_pad|>", "<image>")
# A family whose processor wraps the image's run in text tokens that a run counts as prompt tokens
# (InternVL: <img> ... </img> around its <IMG_CONTEXT> run): its placeholder counts as the wrapper.
_IMAGE_WRAPPERS = {"<IMG_CONTEXT>": ("<img>", "</img>")}


def _template_text(model: str, revision: str | None) -> str | None:
    for name in _TEMPLATE_FILES:
        if name.endswith(".jinja"):
            path = model_file(model, name, revision)
            if path is not None:
                return path.read_text()
            continue
        data = read_json_file(model, name, revision)
        template = (data or {}).get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            return template
    return None


def _generation_tag() -> Any:
    """Jinja's ``{% generation %}...{% endgeneration %}`` as transformers defines it (its
    AssistantTracker, which marks the assistant's part for training masks): the body rendered as
    is. Templates such as LLaVA-OneVision's use it; without it they would not parse here."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


def _render(template: str, messages: list[dict[str, Any]]) -> str:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    extensions = [loopcontrols, _generation_tag()]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = lambda value, **kwargs: json.dumps(value, ensure_ascii=False, **kwargs)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def load_prompt_counter(model: str, revision: str | None = None) -> Callable[[str], int] | None:
    """A function: prompt -> its tokens with the template, the image's placeholder not counted.

    None when the model has no tokenizer.json or no chat template (the planner then estimates).
    """
    tokenizer_file = model_file(model, "tokenizer.json", revision)
    template = _template_text(model, revision)
    if tokenizer_file is None or template is None:
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    marker_ids = {tokenizer.token_to_id(m) for m in _IMAGE_MARKERS} - {None}
    # marker id -> tokens it stands for, when the tokenizer has the marker and its wrapper
    wrapped = {
        tokenizer.token_to_id(marker): len(wrapper)
        for marker, wrapper in _IMAGE_WRAPPERS.items()
        if None not in {tokenizer.token_to_id(t) for t in (marker, *wrapper)}
    }

    def count(prompt: str) -> int:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        ids = tokenizer.encode(_render(template, messages), add_special_tokens=False).ids
        return sum(wrapped.get(token, 0 if token in marker_ids else 1) for token in ids)

    count("x")  # a template that cannot render fails here, not in the middle of a plan
    return count
