"""SkinnyLinear computes what nn.Linear computes; the model copy shares every tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdcp.models import LoadedModel, weights_digest
from sdcp.models.skinny import SkinnyLinear, padded_rows, with_skinny_linears


def test_padding_rule() -> None:
    assert [padded_rows(rows) for rows in range(1, 19)] == [2, 2, 3, 4, 5, 6, 7, 8] + [16] * 8 + [17, 18]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (9,), (15,), (17,), (1, 1), (1, 12), (3, 5), (4, 4)])
def test_same_values_as_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    skinny = SkinnyLinear(linear)
    x = torch.randn(*shape, 48)
    expected = linear(x)
    got = skinny(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_column_major_input_gives_the_same_values() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(32, 24)
    x = torch.randn(32, 6).t()
    torch.testing.assert_close(SkinnyLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_model_copy_shares_tensors_and_leaves_the_original(tiny_loaded: LoadedModel) -> None:
    original = tiny_loaded.model
    linears = sum(type(module) is nn.Linear for module in original.modules())
    copy = with_skinny_linears(original)
    assert copy is not original
    assert sum(isinstance(module, SkinnyLinear) for module in copy.modules()) == linears
    assert not any(type(module) is nn.Linear for module in copy.modules())
    assert sum(type(module) is nn.Linear for module in original.modules()) == linears
    original_tensors = {id(t) for t in (*original.parameters(), *original.buffers())}
    assert all(id(t) in original_tensors for t in (*copy.parameters(), *copy.buffers()))
    assert copy.get_output_embeddings().weight is original.get_output_embeddings().weight
    assert weights_digest(copy) == weights_digest(original)


def test_greedy_output_unchanged(tiny_loaded: LoadedModel) -> None:
    ids = torch.tensor([tiny_loaded.tokenizer("hello world, hello").input_ids])
    copy = with_skinny_linears(tiny_loaded.model)
    with torch.inference_mode():
        expected = tiny_loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        got = copy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert got.tolist() == expected.tolist()


def test_models_off_the_cpu_are_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).to("meta")
    assert with_skinny_linears(model) is model
