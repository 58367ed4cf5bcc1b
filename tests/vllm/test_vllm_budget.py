"""The budget under vLLM: smaller grids from --detail are taken like any other (and equal the
transformers engine), pruning and merging are ignored with a warning (vLLM sizes an image from its
grid)."""

from __future__ import annotations

import logging

from ingest.budget import VisualBudget, job_bounds
from tests.vllm.helpers import assert_same, random_image, request
from worker.tokens.tensors import VisualTokens


def _encode_low(adapter) -> list[VisualTokens]:
    bounds = job_bounds(VisualBudget(detail="low"), ["x"], None, adapter.token_geometry)
    return adapter.encode([random_image(1280, 720, seed=21), random_image(700, 300, seed=22)], bounds)


def test_detail_bounds_equal_the_transformers_engine(vllm_engine, hf_engine, vllm_adapter):
    visuals = _encode_low(vllm_adapter)
    assert [v.num_tokens for v in visuals] == [252, 240]  # low: at most 256 tokens (from 1196 and 275)
    requests = [request(vllm_adapter, vt, f"low-{i}") for i, vt in enumerate(visuals)]
    assert_same(vllm_engine.generate(requests), hf_engine.generate(requests))


def test_pruning_is_ignored_with_a_warning(vllm_engine, hf_engine, vllm_adapter, caplog):
    visuals = _encode_low(vllm_adapter)
    pruned = [request(vllm_adapter, vt, f"prune-{i}", prune_keep=0.5) for i, vt in enumerate(visuals)]
    plain = [request(vllm_adapter, vt, f"prune-{i}") for i, vt in enumerate(visuals)]
    vllm_engine._warned_pruning = False
    with caplog.at_level(logging.WARNING, logger="worker.engines.vllm_engine"):
        out = vllm_engine.generate(pruned)
    assert "pruning" in caplog.text and "ignored by the vLLM engine" in caplog.text
    assert [g.pruned_tokens for g in out] == [0, 0]
    assert_same(out, hf_engine.generate(plain))  # generated unpruned


def test_merging_is_ignored_with_a_warning(vllm_engine, hf_engine, vllm_adapter, caplog):
    visuals = _encode_low(vllm_adapter)
    merged = [request(vllm_adapter, vt, f"merge-{i}", merge_keep=0.5) for i, vt in enumerate(visuals)]
    plain = [request(vllm_adapter, vt, f"merge-{i}") for i, vt in enumerate(visuals)]
    vllm_engine._warned_merging = False
    with caplog.at_level(logging.WARNING, logger="worker.engines.vllm_engine"):
        out = vllm_engine.generate(merged)
    assert "merging" in caplog.text and "ignored by the vLLM engine" in caplog.text
    assert [g.merged_tokens for g in out] == [0, 0]
    assert_same(out, hf_engine.generate(plain))  # generated unmerged
