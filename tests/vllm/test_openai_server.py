"""The openai engine against a real `vllm serve` (the session's, tests/vllm/conftest.py): cached
visual tokens sent as image embeddings give token for token what the in-process vLLM engine and
the transformers engine give (itself equal to the pixel path), under a JSON schema too; prompts
over one image hit the server's prefix cache; a refused request fails alone; 5xx and timeouts
are retried (a flaky proxy in front of the server); an abort stops the request at the server;
and the embedded pipeline stores the rows the transformers engine stores.

Nothing here is mocked but the failures the proxy injects: the server, its HTTP API, its
scheduler and its metrics are vLLM's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from ingest.spec import JobSpec, Sampling
from storage import repository as repo
from tests.media import write_pdf, write_video
from tests.vllm.helpers import (
    SCHEMA,
    SIZES,
    answers,
    assert_same,
    encode,
    generate_at_once,
    random_image,
    request,
    window_request,
)
from tests.vllm.server import FlakyProxy, metric_value
from worker.drivers.embedded import run_job
from worker.engines.openai_engine import OpenAIEngine, OpenAIOptions
from worker.engines.structured import validate_output
from worker.retry import RetryPolicy
from worker.runtime import Runtime

# Budget: one `vllm serve` start (~90 s on 2 cores, more when busy); to be tightened.
pytestmark = pytest.mark.budget(300, reason="one vllm serve start on a CPU")

FAST_RETRY = RetryPolicy(max_retries=3, backoff_base_s=0.05, backoff_max_s=0.2)


def _engine(server, adapter, **kw) -> OpenAIEngine:
    options = dict(url=server.url, api_key=server.api_key, timeout_s=120.0, retry=FAST_RETRY)
    return OpenAIEngine(adapter, OpenAIOptions(**{**options, **kw}))


@pytest.fixture(scope="module")
def server_engine(vllm_server, vllm_adapter) -> Iterator[OpenAIEngine]:
    engine = _engine(vllm_server, vllm_adapter)
    yield engine
    engine.close()


def _wait_for(condition, timeout_s: float = 20.0, what: str = "") -> None:
    """Server metrics arrive with its scheduler's stats, which can trail the answers a little."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_images_of_several_sizes_equal_vllm_in_process_and_transformers(
    server_engine, vllm_engine, hf_engine, vllm_adapter
):
    visuals = encode(vllm_adapter, [random_image(w, h, seed=100 + i) for i, (w, h) in enumerate(SIZES)])
    requests = [request(vllm_adapter, vt, f"srv-size-{i}") for i, vt in enumerate(visuals)]
    out = server_engine.generate(requests)
    assert all(len(g.token_ids) > 0 for g in out)
    assert_same(out, vllm_engine.generate(requests))
    assert_same(out, hf_engine.generate(requests))


def test_json_schema_equals_vllm_in_process_and_transformers(
    server_engine, vllm_engine, hf_engine, vllm_adapter
):
    visuals = encode(vllm_adapter, [random_image(w, h, seed=110 + i) for i, (w, h) in enumerate(SIZES[:3])])
    requests = [
        request(
            vllm_adapter, vt, f"srv-json-{i}", "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA
        )
        for i, vt in enumerate(visuals)
    ]
    out = server_engine.generate(requests)
    for gen in out:
        assert gen.finish_reason == "stop", gen
        value, error = validate_output(gen.text, SCHEMA)
        assert error is None, (gen.text, error)
        assert set(value) == {"label", "count", "ok"}
    assert_same(out, vllm_engine.generate(requests))
    assert_same(out, hf_engine.generate(requests))


def test_windows_from_two_clients_at_once_equal_vllm_in_process_and_transformers(
    vllm_server, vllm_engine, hf_engine, vllm_adapter
):
    """Several image parts in one message (a window, issue 34): two clients send windows of pages
    of different sizes at the same time, one of them with a follow-up turn; the server answers
    each as the in-process engine and the transformers engine do."""
    a = vllm_adapter
    visuals = encode(a, [random_image(w, h, seed=140 + i) for i, (w, h) in enumerate(SIZES)])
    keys = [f"srv-win-{i}" for i in range(len(visuals))]
    ours = [window_request(a, visuals[:3], keys[:3]), window_request(a, visuals[3:], keys[3:])]
    theirs = [
        window_request(
            a, visuals[1:4], keys[1:4], "Extract the fields.", max_new_tokens=64, json_schema=SCHEMA
        ),
        window_request(a, visuals[:2], keys[:2], "And the date?", history=[("What is the total?", "12 EUR")]),
    ]
    got = generate_at_once([_engine(vllm_server, a), _engine(vllm_server, a)], [ours, theirs])
    for requests, out in zip([ours, theirs], got, strict=True):
        assert_same(out, vllm_engine.generate(requests))
        assert_same(out, hf_engine.generate(requests))


def test_prompts_over_one_image_hit_the_server_prefix_cache(
    vllm_server, server_engine, hf_engine, vllm_adapter
):
    (vt,) = encode(vllm_adapter, [random_image(448, 448, seed=120)])  # 256 visual tokens
    prompts = ["What is the total?", "Who is the vendor?", "What is the date?", "Is it paid?"]
    before = server_engine.prefix_cache_stats()
    first = server_engine.generate([request(vllm_adapter, vt, "srv-page-120", prompts[0])])
    rest = server_engine.generate([request(vllm_adapter, vt, "srv-page-120", p) for p in prompts[1:]])

    # Per request (the server's usage.prompt_tokens_details): the image's KV blocks were computed
    # once; every later prompt over it read them from the server's cache.
    assert first[0].cached_tokens == 0
    assert all(g.cached_tokens >= vt.num_tokens // 2 for g in rest), [g.cached_tokens for g in rest]
    assert_same(
        first + rest, hf_engine.generate([request(vllm_adapter, vt, "srv-page-120", p) for p in prompts])
    )
    # The uuid (our cache key) names the image at the server too: the same tensors under another key miss.
    other = server_engine.generate([request(vllm_adapter, vt, "srv-another-key", prompts[1])])
    assert other[0].cached_tokens == 0

    # The server's own Prometheus counters agree.
    hits = sum(g.cached_tokens for g in rest)
    _wait_for(
        lambda: server_engine.prefix_cache_stats()["hits"] - before["hits"] >= hits, what="prefix-cache hits"
    )
    after = server_engine.prefix_cache_stats()
    assert after["queries"] - before["queries"] > hits  # every prompt was looked up, not only the hits


def test_a_refused_request_fails_alone(vllm_server, server_engine, hf_engine, vllm_adapter, caplog):
    visuals = encode(vllm_adapter, [random_image(300, 300, seed=130), random_image(640, 480, seed=131)])
    good = [request(vllm_adapter, vt, f"srv-good-{i}") for i, vt in enumerate(visuals)]
    too_long = request(vllm_adapter, visuals[0], "srv-good-0", max_new_tokens=50_000)  # > max_model_len
    out = server_engine.generate([good[0], too_long, good[1]])
    assert out[1].finish_reason == "error"
    assert "refused" in out[1].error and "HTTP 400" in out[1].error and "max_tokens" in out[1].error, out[
        1
    ].error
    assert len(out[1].error) < 400  # the server's message, shortened
    assert_same([out[0], out[2]], hf_engine.generate(good))

    # A wrong API key: every request refused (401) with the hint; the key never in an error or a log.
    wrong = _engine(vllm_server, vllm_adapter, api_key="wrong-" + vllm_server.api_key)
    with caplog.at_level(logging.DEBUG):
        (denied,) = wrong.generate([good[0]])
    wrong.close()
    assert "HTTP 401" in denied.error and "VISBATCH_LLM_API_KEY" in denied.error, denied.error
    assert vllm_server.api_key not in denied.error and vllm_server.api_key not in caplog.text


def test_5xx_and_timeouts_are_retried(vllm_server, hf_engine, vllm_adapter):
    (vt,) = encode(vllm_adapter, [random_image(448, 448, seed=140)])
    req = request(vllm_adapter, vt, "srv-retry-140")
    # First try: 503 (an overloaded server); second: no answer within the timeout; third: through.
    proxy = FlakyProxy(vllm_server.root, ["503", "hang"])
    try:
        engine = _engine(vllm_server, vllm_adapter, url=proxy.url, timeout_s=3.0)
        (out,) = engine.generate([req])
        engine.close()
        assert proxy.posts == 3 and engine.retries == 2
        assert_same([out], hf_engine.generate([req]))
    finally:
        proxy.close()

    # A server that keeps failing: the request fails after its retries, with the last error.
    proxy = FlakyProxy(vllm_server.root, [], then="503")
    try:
        engine = _engine(vllm_server, vllm_adapter, url=proxy.url, retry=RetryPolicy(1, 0.05, 0.05))
        (out,) = engine.generate([req])
        engine.close()
        assert proxy.posts == 2
        assert out.finish_reason == "error" and "failed 2 tries" in out.error and "HTTP 503" in out.error
    finally:
        proxy.close()


@pytest.mark.alone  # beside another xdist worker's engine, the server once saw the abort too late
def test_abort_stops_the_request_at_the_server(vllm_server, vllm_adapter):
    # Two long answers (12,000 tokens each, over a minute together on this CPU; greedy, they never
    # meet an end-of-text), aborted after a second. The server aborts a request when its API
    # process sees the connection close, and on two busy cores that process trails its engine core
    # by seconds (a CI run saw all of 2 x 3000 tokens generated before the abort took): the answers
    # are long enough for any such lag. The server's gauges are no witness either, its /metrics
    # answered as late; its counters are: once idle, the tokens generated and the requests
    # finished say whether the answers were cut short.
    visuals = encode(vllm_adapter, [random_image(448, 448, seed=71), random_image(448, 448, seed=72)])
    engine = _engine(vllm_server, vllm_adapter)

    def counters() -> tuple[float, float]:
        text = vllm_server.metrics()
        return metric_value(text, "vllm:generation_tokens_total"), metric_value(
            text, "vllm:request_success_total"
        )

    tokens_before, finished_before = counters()
    for i, vt in enumerate(visuals):
        engine.add(f"long-{i}", request(vllm_adapter, vt, f"srv-long-{i}", max_new_tokens=12_000))
    time.sleep(1.0)
    engine.request_abort(["long-0", "long-1"])  # from this thread, as a cancelled job's would
    assert engine.step() == [] and engine.unfinished == 0

    seen = [counters()]
    _wait_for(lambda: seen.append(counters()) or seen[-1] == seen[-2], timeout_s=180, what="the server idle")
    tokens, finished = seen[-1]
    # They ran at the server, and stopped there when their HTTP calls were cancelled (vLLM aborts
    # a request whose client went away): fewer tokens than 2 x 12,000, and neither finished. Not
    # "far fewer": with another test's engine on the two cores, the API process once saw the
    # closed connections only after 87% of the tokens.
    assert 0 < tokens - tokens_before < 2 * 12_000, (tokens_before, seen)
    assert finished == finished_before
    engine.close()


@pytest.mark.parametrize(
    "options",
    [{}, {"window": "2", "then": [["And the date?"], []], "summarize": "Summarize."}],
    ids=["pages", "windows-turns-summaries"],
)
def test_the_embedded_pipeline_with_the_server_equals_transformers(
    vllm_server, vllm_model_dir, settings_factory, tmp_path, options
):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_pdf(inputs / "invoice.pdf", pages=3)
    write_video(inputs / "clip.mp4", seconds=2)
    spec = JobSpec(
        prompts=["What is on this page?", "Is there a table? Answer yes or no."],
        sampling=Sampling(max_new_tokens=6),
        **options,
    )

    def run(engine: str, home: str) -> tuple[Runtime, str]:
        settings = settings_factory(
            home=tmp_path / home,
            engine=engine,
            device="cpu",
            model=str(vllm_model_dir),
            llm_url=vllm_server.url,
            llm_api_key=vllm_server.api_key,
        )
        rt = Runtime(settings)
        return rt, run_job(rt, [inputs], spec)

    hf_rt, hf_job = run("transformers", "hf")
    rt, job = run("openai", "server")
    assert rt.engine.name == "openai" and rt.adapter.vision_only  # encode loads the tower alone
    summary = repo.job_summary(rt.db, job)
    assert summary["status"] == "succeeded", summary["errors"]

    got, want = answers(rt.db, job), answers(hf_rt.db, hf_job)
    windows = 2 + 1 if options else 3 + 2  # the 3 pages in windows of 2, the 2 frames in one
    asked = windows * (len(spec.prompts) + (1 if options else 0)) + (2 if options else 0)
    assert got.keys() == want.keys() and len(got) == asked
    for key, row in got.items():
        assert row["engine"] == "openai" and want[key]["engine"] == "transformers"
        for column in ("text", "completion_tokens", "finish_reason", "prompt_tokens", "visual_tokens"):
            assert row[column] == want[key][column], (key, column)
    rt.engine.close()
