"""Generation by a running vLLM server (`vllm serve`, its OpenAI-compatible API) fed cached visual tokens.

The two-stage split: this worker encodes pages with the vision tower alone (encode stage, local or
on encode workers) and a shared LLM service generates. Each request goes to the server's
`/v1/chat/completions` with each image's cached embeddings as an `image_embeds` content part
(never pixels; a window of pages or frames: one part per image, in order): base64 `.npy` tensors
(numpy's own format, no pickle) plus the grid (`image_grid_thw`, a JSON array) where the family
needs one, built by the adapter's `vllm_image_data` exactly as for in-process vLLM (Qwen3-VL:
main embeddings and deepstack maps concatenated), with the image's cache key as the part's
`uuid`, so the server's prefix cache knows the page across prompts, jobs and clients without
hashing tensors. The server must run with `--enable-mm-embeds` (README, "vLLM
server").

Why messages and not token ids: vLLM 0.32's `/v1/completions` takes token ids but no multimodal
data, and its `/inference/v1/generate` (token in, token out; behind `--enable-scale-out`) takes
images only as URLs or as vLLM's internal msgpack. So the request carries the prompt TEXT and the
server renders the model's chat template, as our adapter does; the answer's `prompt_token_ids`
(`return_token_ids`) must then equal our `prompt_ids` token for token, else the request fails
(another model, tokenizer or template at the server): a result never rests on another prompt.

Equal outputs to the in-process vLLM engine: every sampling field is sent (the server would
otherwise fill unset ones from the model's generation_config.json), with the same values
(repetition penalty from the model's config, greedy as temperature 0), the same schema string and
whitespace rule for structured outputs (the server must use the guidance backend), and the text
is decoded here from the returned token ids with the adapter's tokenizer.

Concurrency: an asyncio loop in one thread keeps up to `max_in_flight` HTTP requests open (the
server batches continuously); the rest wait for a slot, their bodies not yet built (a body holds
the image's embeddings: megabytes on a real model). `step` returns whatever finished, waiting
briefly when nothing has. Timeouts, connection errors, 429 and 5xx are retried with backoff
(worker.retry's policy and storage.errors' classification); a request the server refuses (4xx)
fails alone with the server's message. `request_abort` cancels the HTTP call: vLLM aborts a
request whose client went away. Pruning and merging are refused with a warning, as by the
in-process vLLM engine. The API key (VISBATCH_LLM_API_KEY, else OPENAI_API_KEY) is only ever
put in the Authorization header: never logged, never in an error.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import logging
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx
import numpy as np
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
from worker.retry import RetryPolicy, describe, is_transient

if TYPE_CHECKING:
    from visbatch.settings import Settings

log = logging.getLogger(__name__)

# How long `step` waits for a first answer when none is in: short, so that the generate loop
# still looks for cancelled jobs and flushes results on time; long enough not to spin.
STEP_WAIT_S = 0.05
# The most of a server's message kept in a request's error.
MAX_MESSAGE_CHARS = 300
CONNECT_TIMEOUT_S = 30.0


class LLMServerNotConfigured(ValueError):
    """VISBATCH_ENGINE=openai without VISBATCH_LLM_URL."""


@dataclass(frozen=True)
class OpenAIOptions:
    url: str  # the API's base, e.g. http://host:8000/v1
    api_key: str | None = field(default=None, repr=False)  # never in a repr, hence never in a log
    model: str | None = None  # None: the server's (vLLM serves one model)
    timeout_s: float = 600.0
    max_in_flight: int = 64
    retry: RetryPolicy = RetryPolicy()
    # The server runs where visbatch is installed: its vLLM plugin is loaded there (settings).
    server_plugin: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIOptions:
        if not settings.llm_url:
            raise LLMServerNotConfigured(
                "VISBATCH_ENGINE=openai needs VISBATCH_LLM_URL, the vLLM server's API base "
                "(e.g. http://host:8000/v1); the README's 'vLLM server' section gives the serve command"
            )
        key = settings.llm_api_key.get_secret_value() if settings.llm_api_key else None
        return cls(
            url=settings.llm_url,
            api_key=key or os.environ.get("OPENAI_API_KEY") or None,
            model=settings.llm_model,
            timeout_s=settings.llm_timeout_s,
            max_in_flight=settings.llm_max_in_flight,
            retry=RetryPolicy(max_retries=settings.llm_max_retries),
            server_plugin=settings.llm_server_plugin,
        )

    @property
    def server_root(self) -> str:
        """The server's root (where /health and /metrics are): the API base without its /v1."""
        url = self.url.rstrip("/")
        return url.removesuffix("/v1")


def vllm_serve_args(adapter: ModelAdapter) -> list[str]:
    """The `vllm serve` flags this engine needs for the adapter's family (README, "vLLM server"):
    embeddings in (and for Qwen3-VL one image per prompt, so that the tower module exists for
    deepstack, as in process), the grammar backend and whitespace rule of the other engines,
    and per-request prefix-cache counts in the answers."""
    limits = adapter.vllm_llm_options().get("limit_mm_per_prompt", {"image": 0, "video": 0})
    return [
        "--enable-mm-embeds",
        "--limit-mm-per-prompt",
        json.dumps(limits),
        "--structured-outputs-config",
        json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
        "--enable-prompt-tokens-details",
    ]


def encode_tensor(tensor: torch.Tensor) -> str:
    """A tensor as vLLM's server reads `image_embeds`: base64 of a `.npy` file, never a pickle.

    numpy has no bfloat16: such tensors go as float32, which holds every bfloat16 value exactly,
    and the server casts them back to the model's dtype (twice the bytes on the wire).
    """
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    buffer = io.BytesIO()
    np.save(buffer, tensor.contiguous().numpy(), allow_pickle=False)
    return base64.b64encode(buffer.getbuffer()).decode("ascii")


def image_parts(adapter: ModelAdapter, request: EngineRequest) -> list[dict[str, Any]]:
    """The `image_embeds` content parts of one request's images, one per image in prompt order
    (vLLM's chat API takes several in one message: a window of pages or frames).

    Raises ValueError when the prompt and the visual tokens do not belong together.
    """
    adapter.vllm_prompt(request.prompt_ids, request.images, request.image_keys)  # the same checks
    return [
        {"type": "image_embeds", "image_embeds": _embeds_fields(adapter.vllm_image_data(image)), "uuid": key}
        for image, key in zip(request.images, request.image_keys, strict=True)
    ]


def _embeds_fields(data: torch.Tensor | dict[str, torch.Tensor]) -> str | dict[str, Any]:
    """One image's embeddings as a content part carries them: tensors as base64 `.npy`, and
    integer metadata (Qwen's (1, 3) grid) as a flat JSON array, as vLLM takes it per item."""
    if isinstance(data, torch.Tensor):
        return encode_tensor(data)
    return {
        name: encode_tensor(value) if value.is_floating_point() else value.reshape(-1).tolist()
        for name, value in data.items()
    }


def server_message(response: httpx.Response) -> str:
    """What the server said about a refused request (vLLM: {"error": {"message": ...}}), shortened."""
    try:
        error = response.json().get("error", response.text)
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = response.text
    message = " ".join(str(message).split()) or response.reason_phrase
    return message if len(message) <= MAX_MESSAGE_CHARS else message[: MAX_MESSAGE_CHARS - 3] + "..."


def failure_text(exc: BaseException) -> str:
    """A request's error for what the server or the network did (never headers, never the key)."""
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        hint = " (check VISBATCH_LLM_API_KEY / OPENAI_API_KEY)" if status in (401, 403) else ""
        return f"HTTP {status}: {server_message(exc.response)}{hint}"
    return describe(exc)


class _Live(NamedTuple):
    seq: int  # tells an answer to this request from a late one to an earlier request of the same id
    request: EngineRequest
    future: Future | None


class OpenAIEngine(VLLMFedEngine):
    name = "openai"

    @classmethod
    def plugin_loaded(cls, settings: Settings | None) -> bool:
        # The server is started by someone else, with or without visbatch: the operator says.
        return settings is not None and settings.llm_server_plugin

    def __init__(self, adapter: ModelAdapter, options: OpenAIOptions) -> None:
        # A family vLLM cannot take is refused here.
        super().__init__(adapter, plugin_loaded=options.server_plugin)
        self.options = options
        # httpx logs every request at INFO: hundreds of thousands of lines in one batch run.
        if logging.getLogger("httpx").level == logging.NOTSET:
            logging.getLogger("httpx").setLevel(logging.WARNING)
        self.prefix_cache = PrefixCacheCounts()
        self.retries = 0  # tries repeated after a transient error, over the engine's life
        self._reductions = ReductionWarnings("openai engine (a vLLM server)", log)
        self._live: dict[str, _Live] = {}
        # (request id, seq, the server's JSON answer or a Generation), put by the loop thread.
        self._done: queue.SimpleQueue[tuple[str, int, dict | Generation]] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    @classmethod
    def from_settings(cls, adapter: ModelAdapter, settings: Settings | None = None) -> OpenAIEngine:
        """LLMServerNotConfigured without VISBATCH_LLM_URL."""
        from visbatch.settings import Settings

        return cls(adapter, OpenAIOptions.from_settings(settings or Settings()))

    @cached_property
    def _generation_defaults(self) -> GenerationDefaults:
        return generation_defaults(self.adapter)

    # --- the HTTP loop ---------------------------------------------------------------------

    def _start(self) -> asyncio.AbstractEventLoop:
        """The loop thread and its client, started on the first request."""
        if self._loop is not None:
            return self._loop
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="openai-engine", daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), loop).result()
        self._loop, self._thread = loop, thread
        log.info(
            "openai engine: %s, up to %d requests in flight", self.options.url, self.options.max_in_flight
        )
        return loop

    async def _open(self) -> None:
        o = self.options
        headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=o.url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(o.timeout_s, connect=min(CONNECT_TIMEOUT_S, o.timeout_s)),
            limits=httpx.Limits(max_connections=o.max_in_flight, max_keepalive_connections=o.max_in_flight),
        )
        self._slots = asyncio.Semaphore(o.max_in_flight)

    def close(self) -> None:
        """Cancel what is in flight, close the connections, stop the loop thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for entry in self._live.values():
            if entry.future is not None:
                entry.future.cancel()
        self._live.clear()
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=30)
        # The threads that built request bodies (asyncio.to_thread).
        asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        loop.close()

    async def _run(self, request_id: str, seq: int, request: EngineRequest) -> None:
        """One request, from a free slot to its answer (or failure) in the done queue."""
        try:
            assert self._slots is not None
            async with self._slots:
                try:
                    # The body (megabytes of base64 on a real model) is built only now, off the loop.
                    content = await asyncio.to_thread(self._body_bytes, request)
                except ValueError as exc:
                    outcome: dict | Generation = Generation.failed(f"rejected before the server: {exc}")
                else:
                    outcome = await self._post(content)
        except asyncio.CancelledError:
            raise  # aborted: nothing to report
        except Exception as exc:  # a bug here must fail the request, never leave it in flight forever
            log.exception("openai engine: request %s failed", request_id)
            outcome = Generation.failed(f"openai engine: {describe(exc)}")
        self._done.put((request_id, seq, outcome))

    async def _post(self, content: bytes) -> dict | Generation:
        """POST with retries of transient failures; the server's JSON answer, or a failed Generation."""
        assert self._client is not None
        client, tries = self._client, 0

        async def once() -> dict:
            nonlocal tries
            tries += 1
            response = await client.post(
                "chat/completions", content=content, headers={"Content-Type": "application/json"}
            )
            response.raise_for_status()
            answer = response.json()
            if not isinstance(answer, dict):
                raise ValueError(f"the server answered a JSON {type(answer).__name__}, not an object")
            return answer

        try:
            return await self.options.retry.acall(once, what="LLM server", explain=failure_text)
        except Exception as exc:
            if is_transient(exc):
                return Generation.failed(
                    f"the LLM server failed {tries} tries, the last: {failure_text(exc)}"
                )
            what = "refused the request" if isinstance(exc, httpx.HTTPStatusError) else "call failed"
            return Generation.failed(f"the LLM server {what}: {failure_text(exc)}")
        finally:
            self.retries += tries - 1

    # --- the request ---------------------------------------------------------------------------

    def request_body(self, request: EngineRequest) -> dict[str, Any]:
        """The chat-completions body of one request (raises ValueError for one that cannot go)."""
        if request.prompt is None:
            raise RequestRejected("the openai engine needs the prompt text (EngineRequest.prompt)")
        greedy = request.temperature <= 0
        # The adapter's own messages (its template_ids): the image first, then the first question;
        # a follow-up turn's earlier answers as the assistant's turns, its question last.
        questions = [question for question, _ in request.history] + [request.prompt]
        # A text-only request (a source's summary) has no image part.
        images = image_parts(self.adapter, request) if request.images else []
        messages: list[dict[str, Any]] = [{"role": "user", "content": [*images, _text(questions[0])]}]
        for (_, answer), question in zip(request.history, questions[1:], strict=True):
            messages += [
                {"role": "assistant", "content": [_text(answer)]},
                {"role": "user", "content": [_text(question)]},
            ]
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": request.max_new_tokens,
            # Every sampling field, with the values the in-process engine's SamplingParams get: an
            # unset one would take the model's generation_config.json default at the server.
            "temperature": 0.0 if greedy else request.temperature,
            "top_p": 1.0 if greedy else request.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": self._generation_defaults.repetition_penalty,
            "n": 1,
            # The prompt the server rendered (checked against ours) and the generated ids.
            "return_token_ids": True,
        }
        if not greedy:
            body["seed"] = request.seed
        if self.options.model:
            body["model"] = self.options.model
        if request.json_schema is not None:
            body["structured_outputs"] = {
                "json": schema_string(request.json_schema),
                "disable_any_whitespace": True,
            }
        return body

    def _body_bytes(self, request: EngineRequest) -> bytes:
        return json.dumps(self.request_body(request)).encode()

    def _generation(self, request: EngineRequest, answer: dict) -> Generation:
        """The server's answer as a Generation, if it generated from exactly our prompt."""
        try:
            choice = answer["choices"][0]
            finish = choice["finish_reason"]
            token_ids = list(choice["token_ids"])
            prompt_ids = list(answer["prompt_token_ids"])
        except (KeyError, IndexError, TypeError):
            return Generation.failed(
                "the server's answer has no token ids (choices[0].token_ids, prompt_token_ids): "
                "VISBATCH_ENGINE=openai needs a vLLM server (return_token_ids)"
            )
        if finish not in ("stop", "length"):
            return Generation.failed(f"the server finished the request with {finish!r}")
        if prompt_ids != request.prompt_ids:
            at = next(
                (i for i, (a, b) in enumerate(zip(prompt_ids, request.prompt_ids, strict=False)) if a != b),
                None,
            )
            where = (
                f"token {at}" if at is not None else f"length {len(prompt_ids)} vs {len(request.prompt_ids)}"
            )
            return Generation.failed(
                f"the server rendered another prompt than ours (first difference at {where}): it must "
                "serve the same model, tokenizer and chat template as VISBATCH_MODEL"
            )
        token_ids = completion_ids(token_ids, finish, self._generation_defaults.eos_token_ids)
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")  # present with `--enable-prompt-tokens-details`
        self.prefix_cache.prompt_tokens += len(prompt_ids)
        self.prefix_cache.cached_tokens += cached or 0
        return Generation(
            token_ids=token_ids,
            text=self.adapter.tokenizer.decode(token_ids, skip_special_tokens=True),
            finish_reason=finish,
            cached_tokens=cached,
        )

    # --- the step API --------------------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return len(self._live)

    def add(self, request_id: str, request: EngineRequest) -> None:
        self._reductions.check(request)
        seq = next(self._seq)
        try:
            check_request(request, self.adapter.token_spec)  # a malformed tensor never leaves here
        except RequestRejected as exc:
            log.warning("request rejected before the server: %s", exc)
            self._live[request_id] = _Live(seq, request, None)
            self._done.put((request_id, seq, Generation.failed(f"rejected before the server: {exc}")))
            return
        self._generation_defaults  # noqa: B018  (read here once, not first by the body-building threads)
        future = asyncio.run_coroutine_threadsafe(self._run(request_id, seq, request), self._start())
        # Its answer cannot be taken before this: only this thread runs `step`.
        self._live[request_id] = _Live(seq, request, future)

    def request_abort(self, request_ids) -> None:
        ids = list(request_ids)
        super().request_abort(ids)
        for request_id in ids:
            entry = self._live.get(request_id)
            if entry is not None and entry.future is not None:
                # Cancels the HTTP call (waiting for a slot, or at the server: vLLM aborts a request
                # whose connection closes); its answer, if any, is dropped at the next step.
                entry.future.cancel()

    def step(self) -> list[tuple[str, Generation]]:
        for request_id in self._take_aborts(self._live):
            entry = self._live.pop(request_id)
            if entry.future is not None:
                entry.future.cancel()
        if not self._live:
            return []
        try:
            items = [self._done.get(timeout=STEP_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        finished = []
        for request_id, seq, outcome in items:
            entry = self._live.get(request_id)
            if entry is None or entry.seq != seq:
                continue  # aborted meanwhile (or an answer to an earlier request under this id)
            del self._live[request_id]
            if not isinstance(outcome, Generation):
                outcome = self._generation(entry.request, outcome)
            finished.append((request_id, outcome))
        return finished

    # --- stats ---------------------------------------------------------------------------------

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prompt tokens the server's prefix cache was asked for ("queries") and served ("hits"):
        vLLM's Prometheus counters from the server's /metrics, so the whole server's, every
        client's. Exact numbers for this engine's own requests: `Generation.cached_tokens` and
        `self.prefix_cache` (with the server's `--enable-prompt-tokens-details`)."""
        counters = self.server_counters(("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"))
        return {
            "queries": int(counters["vllm:prefix_cache_queries"]),
            "hits": int(counters["vllm:prefix_cache_hits"]),
        }

    def server_counters(self, names: tuple[str, ...]) -> dict[str, float]:
        """These counters (without `_total`) from the server's /metrics, summed over their labels."""
        headers = {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}
        response = httpx.get(f"{self.options.server_root}/metrics", headers=headers, timeout=30)
        response.raise_for_status()
        totals = dict.fromkeys(names, 0.0)
        for line in response.text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            metric, _, value = line.rpartition(" ")
            base = metric.split("{", 1)[0].removesuffix("_total")
            if base in totals:
                totals[base] += float(value)
        return totals


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}
