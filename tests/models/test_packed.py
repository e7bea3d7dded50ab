"""PackedLinear computes what nn.Linear computes; the model copy shares every tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdcp.models import LoadedModel, weights_digest
from sdcp.models.hf.packed import PackedLinear, pack_weights, with_packed_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1,), (2,), (3,), (9,), (16,), (17,), (1, 1), (1, 12), (3, 5), (0, 4)])
def test_same_values_as_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape, 48)
    with torch.inference_mode():
        expected = linear(x)
        got = packed(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_column_major_input_gives_the_same_values() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(32, 24)
    x = torch.randn(32, 6).t()
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_model_copy_shares_tensors_and_leaves_the_original(tiny_loaded: LoadedModel) -> None:
    original = tiny_loaded.model
    linears = sum(type(module) is nn.Linear for module in original.modules())
    copy = with_packed_linears(original)
    assert copy is not original
    assert sum(isinstance(module, PackedLinear) for module in copy.modules()) == linears
    assert not any(type(module) is nn.Linear for module in copy.modules())
    assert sum(type(module) is nn.Linear for module in original.modules()) == linears
    original_tensors = {id(t) for t in (*original.parameters(), *original.buffers())}
    assert all(id(t) in original_tensors for t in (*copy.parameters(), *copy.buffers()))
    assert copy.get_output_embeddings().weight is original.get_output_embeddings().weight
    assert copy.state_dict().keys() == original.state_dict().keys()
    assert weights_digest(copy) == weights_digest(original)


def test_greedy_output_unchanged(tiny_loaded: LoadedModel) -> None:
    ids = torch.tensor([tiny_loaded.tokenizer("hello world, hello").input_ids])
    copy = with_packed_linears(tiny_loaded.model)
    with torch.inference_mode():
        expected = tiny_loaded.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
        )
        got = copy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("device, dtype", [("meta", torch.float32), ("cpu", torch.bfloat16)])
def test_models_off_the_cpu_or_not_in_float32_keep_their_linears(device: str, dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(4, 4)).to(device=device, dtype=dtype)
    copy = with_packed_linears(model)
    assert copy is not model and type(copy[0]) is nn.Linear
    assert copy[0].weight is model[0].weight


def test_pack_weights_packs_every_layer_ahead_of_the_first_call(tiny_loaded: LoadedModel) -> None:
    copy = with_packed_linears(tiny_loaded.model)
    layers = [module for module in copy.modules() if isinstance(module, PackedLinear)]
    assert layers and all(layer._packed is None for layer in layers)
    pack_weights(copy)
    assert all(layer._packed is not None for layer in layers)
    ids = torch.tensor([tiny_loaded.tokenizer("hello world").input_ids])
    with torch.inference_mode():
        torch.testing.assert_close(
            copy(input_ids=ids).logits, tiny_loaded.model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
