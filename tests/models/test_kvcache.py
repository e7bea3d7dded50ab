"""GrowableLayer appends in place and behaves as transformers' DynamicLayer does."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from sdcp.models.hf.kvcache import GrowableLayer


def _states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, length, 4, generator=generator), torch.randn(1, 2, length, 4, generator=generator)


def test_same_contents_as_dynamic_layer_through_appends_and_crops() -> None:
    growable, dynamic = GrowableLayer(), DynamicLayer()
    steps = [("append", 5), ("append", 70), ("crop", -3), ("append", 1), ("crop", -40), ("append", 100)]
    for seed, (kind, amount) in enumerate(steps):
        if kind == "append":
            keys, values = _states(amount, seed)
            got = growable.update(keys, values)
            want = dynamic.update(keys, values)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        else:
            growable.crop(amount)
            dynamic.crop(amount)
        assert growable.get_seq_length() == dynamic.get_seq_length()
        torch.testing.assert_close(growable.keys, dynamic.keys, rtol=0, atol=0)


def test_appends_write_in_place_until_full() -> None:
    layer = GrowableLayer()
    layer.update(*_states(3, 0))
    buffer = layer.keys.data_ptr()
    for seed in range(1, 20):
        layer.update(*_states(1, seed))
    assert layer.keys.data_ptr() == buffer
    layer.update(*_states(200, 99))
    assert layer.get_seq_length() == 222


def test_replaced_keys_are_not_mistaken_for_the_buffer() -> None:
    layer = GrowableLayer()
    layer.update(*_states(4, 0))
    layer.batch_select_indices(torch.tensor([0]))
    before = layer.keys.clone()
    keys, values = _states(2, 1)
    layer.update(keys, values)
    torch.testing.assert_close(layer.keys, torch.cat([before, keys], dim=-2), rtol=0, atol=0)
