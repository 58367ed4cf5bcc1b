from __future__ import annotations

import random

import pytest

from worker.tokens.packing import PackItem, pack_by_tokens, padding_waste


def _items(n: int, seed: int = 0) -> list[PackItem[int]]:
    rng = random.Random(seed)
    # Mixed pages (~1,300 tokens) and frames (~100-300 tokens), in arrival order.
    sizes = [rng.choice([rng.randint(1100, 1400), rng.randint(80, 320)]) for _ in range(n)]
    return [
        PackItem(payload=i, input_tokens=s, max_new_tokens=64, affinity=str(i)) for i, s in enumerate(sizes)
    ]


def test_every_batch_within_budget_and_size():
    batches = pack_by_tokens(_items(300), batch_tokens=8192, max_batch_size=8)
    assert sorted(i.payload for b in batches for i in b.items) == list(range(300))
    for batch in batches:
        assert len(batch.items) <= 8
        assert batch.cost <= 8192


def test_sorting_cuts_padding_against_arrival_order():
    items = _items(400, seed=3)
    packed = pack_by_tokens(items, batch_tokens=16384, max_batch_size=16)
    fixed = [
        pack_by_tokens(items[i : i + 8], batch_tokens=10**9, max_batch_size=8, bucket=10**9, max_padding=1.0)
        for i in range(0, len(items), 8)
    ]
    arrival_waste = padding_waste([b for group in fixed for b in group])
    assert padding_waste(packed) < 0.05 < arrival_waste


def test_oversized_request_gets_its_own_batch():
    items = [
        PackItem(payload="big", input_tokens=5000, max_new_tokens=10),
        PackItem(payload="s", input_tokens=10, max_new_tokens=10),
    ]
    batches = pack_by_tokens(items, batch_tokens=1000, max_batch_size=4)
    assert [[i.payload for i in b.items] for b in batches] == [["s"], ["big"]]


def test_groups_never_share_a_batch():
    items = [PackItem(payload=i, input_tokens=100, max_new_tokens=10, group=i % 2) for i in range(10)]
    for batch in pack_by_tokens(items, batch_tokens=10**6, max_batch_size=100):
        assert len({i.group for i in batch.items}) == 1


def test_same_image_prompts_stay_adjacent():
    items = [
        PackItem(payload=(img, p), input_tokens=300 + p, max_new_tokens=10, affinity=f"img{img}")
        for p in range(3)
        for img in range(4)
    ]
    order = [
        i.payload[0] for b in pack_by_tokens(items, batch_tokens=10**6, max_batch_size=100) for i in b.items
    ]
    assert order == sorted(order)


def test_bad_limits():
    with pytest.raises(ValueError):
        pack_by_tokens([], batch_tokens=0, max_batch_size=1)


def test_long_request_does_not_join_short_ones():
    items = [PackItem(payload=i, input_tokens=100, max_new_tokens=10) for i in range(3)]
    items.append(PackItem(payload="long", input_tokens=1300, max_new_tokens=10))
    batches = pack_by_tokens(items, batch_tokens=10**6, max_batch_size=16)
    assert [len(b.items) for b in batches] == [3, 1]
    assert padding_waste(batches) == 0.0
