"""What the two vLLM engines share, so that in-process vLLM and a `vllm serve` answer alike.

The in-process engine (worker.engines.vllm_engine) builds vLLM's SamplingParams itself; the
server engine (worker.engines.openai_engine) sends the same values as request fields. Both take
them from here: the model's end-of-sequence ids and repetition penalty (transformers applies
generation_config.json's penalty even when greedy, vLLM only what it is given), the schema string
(the grammar fixes the order of properties, so equal text needs an equal string), the trimming of
the end-of-sequence token vLLM keeps in its output, the warning for pruning or merging,
which vLLM cannot do (it sizes each image from its grid), and their base class
(`VLLMFedEngine`), which refuses the families vLLM cannot take.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ingest.token_rules import UnsupportedModel
from worker.engines.base import RequestRejected, StepEngine
from worker.tokens.tensors import InvalidVisualTokens

if TYPE_CHECKING:
    from visbatch.settings import Settings
    from worker.engines.base import EngineRequest
    from worker.models.base import ModelAdapter
    from worker.tokens.tensors import TokenSpec


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int]
    repetition_penalty: float


def generation_defaults(adapter: ModelAdapter) -> GenerationDefaults:
    """End-of-sequence ids and repetition penalty from the model's generation config (read from
    its folder or the hub: no weights), plus the tokenizer's end of sequence."""
    from transformers import GenerationConfig

    ref = adapter.ref
    eos: set[int] = set()
    penalty = 1.0
    try:
        config = GenerationConfig.from_pretrained(ref.source, revision=ref.revision)
        ids = config.eos_token_id
        eos.update([ids] if isinstance(ids, int) else list(ids or []))
        penalty = float(config.repetition_penalty or 1.0)
    except OSError:  # no generation_config.json: the tokenizer's end of sequence only
        pass
    if adapter.tokenizer.eos_token_id is not None:
        eos.add(int(adapter.tokenizer.eos_token_id))
    return GenerationDefaults(frozenset(eos), penalty)


def schema_string(schema: dict[str, Any]) -> str:
    """The schema exactly as worker.engines.structured hands it to llguidance (keys sorted)."""
    return json.dumps(schema, sort_keys=True)


def completion_ids(token_ids: Iterable[int], finish_reason: str, eos: frozenset[int]) -> list[int]:
    """vLLM keeps the end-of-sequence token in its output; the transformers engine does not."""
    ids = list(token_ids)
    if finish_reason == "stop" and ids and ids[-1] in eos:
        ids = ids[:-1]
    return ids


class ReductionWarnings:
    """Warns once per engine that pruning / merging / static-patch dropping are ignored: vLLM
    expands each image placeholder to the grid's token count and computes the positions itself,
    so it cannot take fewer embeddings than the grid implies. Such requests run in full
    (pruned/merged_tokens=0)."""

    def __init__(self, engine_label: str, logger: logging.Logger) -> None:
        self.engine_label = engine_label
        self.log = logger  # the engine's own, so its warnings are filtered and found under its name
        self._warned: set[str] = set()

    def check(self, request: EngineRequest) -> None:
        for what, active, setting, verb in (
            ("pruning", request.prune_keep < 1.0, f"prune_keep={request.prune_keep:g}", "prune"),
            ("merging", request.merge_keep < 1.0, f"merge_keep={request.merge_keep:g}", "merge"),
            ("static-patch dropping", request.drop_static > 0, f"drop_static={request.drop_static:g}",
             "drop a window's static patches"),
        ):  # fmt: skip
            if active and what not in self._warned:
                self._warned.add(what)
                self.log.warning(
                    "visual-token %s (%s) is ignored by the %s: vLLM sizes each image from "
                    "its grid and cannot take fewer tokens; use --detail or --max-pixels to spend "
                    "fewer tokens, or VISBATCH_ENGINE=transformers to %s",
                    what, setting, self.engine_label, verb,
                )  # fmt: skip


class VLLMUnsupportedFamily(UnsupportedModel):
    """A vLLM engine (in process or a server) was asked for a model family whose cached tokens
    vLLM cannot take: the setting's error, said before any weight loads."""


class VLLMFedEngine(StepEngine):
    """An engine that feeds the cached tokens to vLLM (in process or a server): both refuse, in
    this one place, a family whose tokens vLLM cannot take (`ModelAdapter.vllm_unsupported`).
    `choose_engine` asks before any weight loads; the constructor asks again for an engine built
    directly (tests, benchmarks), before anything starts."""

    vllm_fed = True

    def __init__(self, adapter: ModelAdapter, *, plugin_loaded: bool = True) -> None:
        self._refuse(adapter, plugin_loaded)
        super().__init__()
        self.adapter = adapter

    @classmethod
    def plugin_loaded(cls, settings: Settings | None) -> bool:
        """Whether visbatch's vLLM plugin is surely loaded where this engine's vLLM runs: in this
        installation (the in-process engine) yes; a server says so by a setting."""
        return True

    @classmethod
    def refuse_family(cls, adapter: ModelAdapter, settings: Settings | None = None) -> None:
        """VLLMUnsupportedFamily, with the family's reason and the setting to use, when vLLM
        cannot take this adapter's cached tokens."""
        cls._refuse(adapter, cls.plugin_loaded(settings))

    @classmethod
    def _refuse(cls, adapter: ModelAdapter, plugin_loaded: bool) -> None:
        unsupported = getattr(adapter, "vllm_unsupported", None)
        if not unsupported and getattr(adapter, "vllm_needs_plugin", False) and not plugin_loaded:
            unsupported = (
                "vLLM takes its cached tokens (pages of mixed sizes; Idefics3's at all) only with "
                "visbatch's vLLM plugin loaded, which a server started elsewhere may lack (without it, "
                "two page sizes in one step kill the server): install visbatch where the server runs and "
                "set VISBATCH_LLM_SERVER_PLUGIN=true, or use VISBATCH_ENGINE=vllm"
            )
        if unsupported:
            raise VLLMUnsupportedFamily(
                f"VISBATCH_ENGINE={cls.name} cannot run {adapter.family}: {unsupported}; "
                "use VISBATCH_ENGINE=transformers (or auto, which picks it for this family)"
            )


def check_request(request: EngineRequest, spec: TokenSpec) -> None:
    """Raise RequestRejected unless the request's visual tokens fit the model exactly."""
    try:
        for image in request.images:
            image.check(spec)
    except InvalidVisualTokens as exc:
        raise RequestRejected(str(exc)) from None
    if request.max_new_tokens < 1:
        raise RequestRejected("max_new_tokens must be at least 1")


@dataclass
class PrefixCacheCounts:
    """This engine's prompt tokens and how many of them vLLM's prefix cache served (exact)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
