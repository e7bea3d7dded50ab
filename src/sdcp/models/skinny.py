"""Linear layers for the few-row inputs of decoding and verification on CPUs.

Decoding feeds one row per session and a verification pass M + 1 rows. For such inputs torch's
``nn.Linear`` (``x @ W.T``) takes a path in MKL's sgemm that reads the weights at about a third of
the memory bandwidth, and its cost does not even grow with the rows: on this project's 2-core CPU
the 211 linear layers of SmolLM2-135M take 32 ms for 1 row, 51 ms for 2 and 66 ms for 3.
Computing the same product as ``(W @ x.T).T`` takes 15 ms for 2 rows, 16 ms for 4 and 33 ms for 8
(``docs/models.md``). That form is slow for exactly one row (32 ms) and for 9 to 15 rows, so
those are padded with copies of the last row to 2 and to 16 rows; extra rows are cut off again.

Each output row is a dot product of the same weights with the same input row in both forms; only
the order of the float additions differs, as it already does between batch shapes.
"""

from __future__ import annotations

import copy
from itertools import chain

import torch
from torch import nn

__all__ = ["SkinnyLinear", "padded_rows", "with_skinny_linears"]


def padded_rows(rows: int) -> int:
    """The row count to compute for ``rows`` input rows (see the module docstring)."""
    if rows == 1:
        return 2
    if 9 <= rows <= 15:
        return 16
    return rows


class SkinnyLinear(nn.Module):
    """An ``nn.Linear`` computed as ``(W @ x.T).T``, sharing the original's parameters."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The same Parameter objects: tied weights stay tied and the state dict keeps its names.
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Row-major rows: the fast path needs ``rows.t()`` to be the transposed view, and outputs
        # of this layer (fed to the next through elementwise ops) are column-major.
        rows = x.reshape(-1, self.in_features).contiguous()
        count = rows.shape[0]
        padded = padded_rows(count)
        if padded > count:
            rows = torch.cat([rows, rows[-1:].expand(padded - count, -1)])
        out = torch.mm(self.weight, rows.t()).t()[:count]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def with_skinny_linears(model: nn.Module) -> nn.Module:
    """A copy of a CPU model whose ``nn.Linear`` layers are `SkinnyLinear`s.

    Only the module objects are copied: parameters and buffers are shared with ``model``, which
    is left as it was. A model with tensors on another device is returned as it is: the
    measurements behind this are MKL's on CPUs.
    """
    tensors = list(chain(model.parameters(), model.buffers()))
    if any(tensor.device.type != "cpu" for tensor in tensors):
        return model
    clone = copy.deepcopy(model, memo={id(tensor): tensor for tensor in tensors})
    for parent in list(clone.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SkinnyLinear(child))
    return clone
