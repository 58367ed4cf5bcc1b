from __future__ import annotations

import pytest

from worker.engines import EngineRequest, make_engine
from worker.engines.structured import SchemaError, check_schema, validate_output

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["invoice", "receipt", "other"]}, "has_table": {"type": "boolean"}},
    "required": ["kind", "has_table"],
    "additionalProperties": False,
}


def test_validate_output():
    assert validate_output('{"kind": "invoice", "has_table": true}', SCHEMA) == (
        {"kind": "invoice", "has_table": True},
        None,
    )
    value, error = validate_output('{"kind": "poem", "has_table": true}', SCHEMA)
    assert value is None and "kind" in error
    value, error = validate_output('{"kind": "inv', SCHEMA)
    assert value is None and "not valid JSON" in error


def test_check_schema_rejects_invalid():
    with pytest.raises(SchemaError):
        check_schema({"type": "no-such-type"})
    check_schema(SCHEMA)


@pytest.mark.slow
def test_constrained_generation_is_valid_json(tiny_adapter):
    """The random model writes garbage; constrained to the schema it must still write valid JSON."""
    import numpy as np
    from PIL import Image

    engine = make_engine("transformers", tiny_adapter)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 255, (224, 224 + 28 * i, 3), dtype=np.uint8)) for i in range(3)]
    requests = [
        EngineRequest(
            prompt_ids=tiny_adapter.prompt_ids("Classify this document.", vt),
            visual=vt,
            cache_key=str(i),
            max_new_tokens=48,
            json_schema=SCHEMA if i != 1 else None,  # a batch may mix constrained and free rows
        )
        for i, vt in enumerate(tiny_adapter.encode(images))
    ]
    outputs = engine.generate(requests)
    for i, gen in enumerate(outputs):
        if i == 1:
            continue
        value, error = validate_output(gen.text, SCHEMA)
        assert error is None, gen.text
        assert gen.finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["internvl"])
def test_constrained_generation_is_valid_json_for_tiled_families(family_model_dir, family):
    """The same, for a family whose pages are several tiles (InternVL: up to 12 and a thumbnail):
    a batch of pages of different tile grids, constrained and free rows mixed."""
    import numpy as np
    from PIL import Image

    from worker.models import ModelRef, load_adapter

    adapter = load_adapter(ModelRef(str(family_model_dir(family))))
    engine = make_engine("transformers", adapter)
    rng = np.random.default_rng(2)
    sizes = [(448, 448), (700, 300), (300, 900)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    visuals = adapter.encode(images)
    assert len({v.num_tokens for v in visuals}) == 3  # three tile grids
    requests = [
        EngineRequest(
            prompt_ids=adapter.prompt_ids("Classify this document.", vt),
            visual=vt,
            cache_key=str(i),
            max_new_tokens=48,
            json_schema=SCHEMA if i != 1 else None,
        )
        for i, vt in enumerate(visuals)
    ]
    for i, gen in enumerate(engine.generate(requests)):
        if i == 1:
            continue
        value, error = validate_output(gen.text, SCHEMA)
        assert error is None, gen.text
        assert gen.finish_reason == "stop"
