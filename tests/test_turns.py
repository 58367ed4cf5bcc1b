"""Follow-up turns (issue 34, `--then`): a prompt's conversation goes on over the same images,
each turn seeing the earlier turns and their answers; one result row per turn."""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import text

from ingest.spec import JobSpec, Sampling, SpecError, spec_from_fields
from storage import repository as repo
from tests.media import write_pdf
from tests.test_cached_equals_pixels import _random_image, _through_cache
from worker.cli.job_options import _then_after
from worker.drivers.embedded import run_job
from worker.errors import UserError
from worker.job_options import JobOptions
from worker.runtime import Runtime
from worker.stages.generate.loop import _questions_left
from worker.stages.generate.requests import Question

# --- the options ----------------------------------------------------------------------------


def test_each_then_follows_the_prompt_before_it() -> None:
    order = ["prompt", "then", "model", "prompt", "then", "then"]
    assert _then_after(order) == [0, 1, 1]
    values = {"prompt": ["A?", "B?"], "then": ["A1", "B1", "B2"], "then_after": _then_after(order)}
    assert JobOptions.with_defaults(values, python=False).spec().then == [["A1"], ["B1", "B2"]]


def test_a_then_before_any_prompt_is_refused() -> None:
    values = {"prompt": ["A?"], "then": ["first?"], "then_after": _then_after(["then", "prompt"])}
    with pytest.raises(UserError, match="--then before any --prompt"):
        JobOptions.with_defaults(values, python=False).spec()


def test_python_callers_give_a_list_per_prompt_or_one_for_one_prompt() -> None:
    one = JobOptions.with_defaults({"prompt": ["A?"], "then": ["A1", "A2"]}).spec()
    assert one.then == [["A1", "A2"]] and one.questions() == [(0, 0), (0, 1), (0, 2)]
    two = JobOptions.with_defaults({"prompt": ["A?", "B?"], "then": [[], ["B1"]]}).spec()
    assert two.questions() == [(0, 0), (1, 0), (1, 1)]
    with pytest.raises(UserError, match="which prompt does it follow"):
        JobOptions.with_defaults({"prompt": ["A?", "B?"], "then": ["X"]}).spec()


def test_the_spec_checks_its_turns() -> None:
    with pytest.raises(SpecError, match="then: a follow-up turn must not be empty"):
        spec_from_fields({"prompts": ["A?"], "then": [["  "]]})
    with pytest.raises(SpecError, match=r"then: one list of follow-ups per prompt \(1\), not 2"):
        spec_from_fields({"prompts": ["A?"], "then": [["x"], ["y"]]})


def test_a_resumed_conversation_goes_on_from_its_first_turn_without_an_answer() -> None:
    spec = JobSpec(prompts=["A?", "B?"], then=[["A1", "A2"], []])
    left = _questions_left(spec, {(0, 0): "a0", (1, 0): "b0"})
    assert left == [Question(0, 1, (("A?", "a0"),))]
    assert _questions_left(spec, {}) == [Question(0), Question(1)]


# --- the prompt a follow-up turn is -------------------------------------------------------


@pytest.mark.slow
def test_a_follow_up_prompt_is_the_processors_conversation(family_adapter) -> None:
    """The chat a turn continues, as the model's own processor renders it (the images in the
    first user turn, each earlier answer as the assistant's turn)."""
    adapter = family_adapter
    image = _random_image(448, 300, seed=7)
    [visual] = _through_cache(adapter, [image])
    history = (("What is on this page?", "A table of totals."), ("Which total is largest?", "The third."))
    ids = adapter.prompt_ids("Say it in French.", visual, history)
    content = [{"type": "image"}, {"type": "text", "text": history[0][0]}]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": history[0][1]}]},
        {"role": "user", "content": [{"type": "text", "text": history[1][0]}]},
        {"role": "assistant", "content": [{"type": "text", "text": history[1][1]}]},
        {"role": "user", "content": [{"type": "text", "text": "Say it in French."}]},
    ]
    processor = adapter.processor
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[image]], return_tensors="pt")["input_ids"][0].tolist()
    assert ids == expected
    assert isinstance(expected, list) and torch.is_tensor(visual.embeds)


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, "2"])
def test_every_turn_answered_once_with_the_turns_before_it(settings_factory, tmp_path, window) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    write_pdf(folder / "doc.pdf", pages=2)
    spec = JobSpec(
        prompts=["What is on this page?", "Any table?"],
        then=[["And the total?", "In words?"], []],
        sampling=Sampling(max_new_tokens=3),
        window=window,
    )
    rt = Runtime(settings_factory())
    job_id = run_job(rt, [folder], spec)
    summary = repo.job_summary(rt.db, job_id)
    assert summary["status"] == "succeeded", summary
    rows = {(r["unit"], r["prompt_index"], r["turn"]): r for r in repo.iter_results(rt.db, job_id)}
    units = [0] if window else [0, 1]
    assert sorted(rows) == sorted((u, p, t) for u in units for p, t in spec.questions())
    assert all(r["error"] is None for r in rows.values())
    for u in units:  # each turn's prompt holds the turns before it and their answers
        assert (
            rows[u, 0, 0]["prompt_tokens"] < rows[u, 0, 1]["prompt_tokens"] < rows[u, 0, 2]["prompt_tokens"]
        )
    exported = {(r["unit_index"], r["turn"], r["prompt"]) for r in _exported(rt, job_id)}
    assert (0, 2, "In words?") in exported and (0, 0, "What is on this page?") in exported
    sql = "SELECT prompt FROM result_rows WHERE job_id = :job AND prompt_index = 0 AND unit_index = 0"
    with rt.db.engine.connect() as connection:
        viewed = connection.execute(text(sql + " ORDER BY turn"), {"job": job_id}).scalars().all()
    assert viewed == ["What is on this page?", "And the total?", "In words?"]


def _exported(rt: Runtime, job_id: str) -> list[dict]:
    from worker.results_export import export_records

    spec = JobSpec.model_validate(repo.job_state(rt.db, job_id)[1])
    return list(export_records(repo.iter_results(rt.db, job_id), spec.prompts, spec.then))
