"""The adapter interface stays family-neutral, and every family plugs into it the same way.

Qwen's geometry (grid_thw, merge size, M-RoPE, mm_token_type_ids) belongs to the Qwen adapters;
the base class, the engines and the token reduction only talk to the interface. Checked by AST
(names and attributes used in CODE; docstrings and comments may explain them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.model_fixtures import FAMILIES
from worker.models import ADAPTERS, adapter_class

ROOT = Path(__file__).resolve().parents[1]
NEUTRAL = [
    "worker/models/base.py",
    "worker/engines/base.py",
    "worker/engines/transformers_engine.py",
    "worker/engines/vllm_engine.py",
    "worker/tokens/reduction.py",
    "worker/tokens/merging.py",
    "worker/tokens/pruning.py",
    "worker/tokens/tensors.py",
]
QWEN_ISMS = {
    "grid_thw",
    "image_grid_thw",
    "merge_size",
    "get_rope_index",
    "mm_token_type_ids",
    "mrope_section",
}


def _code_words(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(node.value.replace('"', " ").split())
    return words


@pytest.mark.parametrize("module", NEUTRAL)
def test_no_qwen_geometry_outside_the_qwen_adapters(module):
    used = _code_words(ROOT / module) & QWEN_ISMS
    # VisualTokens names its layout field grid_thw (kept for the cache format); only it may.
    if module == "worker/tokens/tensors.py":
        used -= {"grid_thw"}
    assert not used, f"{module} uses {sorted(used)}: move it into the family's adapter"


def test_every_family_has_an_adapter_and_a_tiny_model():
    assert sorted(ADAPTERS) == sorted(FAMILIES)
    for family in FAMILIES:
        assert adapter_class(family).family == family


def test_prompt_ids_take_the_visual_tokens_not_a_count(tiny_adapter):
    # The old signature took a count; the layout can shape the prompt (Idefics3), so it is refused.
    with pytest.raises(TypeError, match="VisualTokens"):
        tiny_adapter.prompt_ids("x", 5)
    text_only = tiny_adapter.prompt_ids("x", None)
    assert tiny_adapter.image_token_id not in text_only


def test_a_vllm_engine_for_a_family_it_cannot_run_is_refused_before_any_weight_loads(
    family_model_dir, tmp_path
):
    """Idefics3 (like InternVL and LLaVA-OneVision) is fed cached tokens by vLLM only through
    visbatch's plugin, which a server started elsewhere may lack: a job asking for the openai
    engine without VISBATCH_LLM_SERVER_PLUGIN fails at once with the reason and what to set
    instead, not as an unexpected "model could not be loaded" after its weights were read."""
    from ingest.token_rules import UnsupportedModel
    from visbatch.settings import Settings
    from worker.runtime import Runtime

    rt = Runtime(Settings(home=tmp_path / "home", model=str(family_model_dir("idefics3")), engine="openai"))
    with pytest.raises(UnsupportedModel) as refused:
        _ = rt.adapter
    message = str(refused.value)
    assert "VISBATCH_ENGINE=openai cannot run idefics3:" in message
    assert "VISBATCH_LLM_SERVER_PLUGIN=true" in message and "VISBATCH_ENGINE=transformers" in message
    assert "adapter" not in rt.__dict__  # nothing kept: the job fails as it starts
