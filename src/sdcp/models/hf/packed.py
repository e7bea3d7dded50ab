"""Linear layers for the few-row inputs of decoding and verification on CPUs: oneDNN, prepacked.

Decoding feeds one row per session and a verification pass M + 1 rows. For such inputs torch's
``nn.Linear`` runs MKL's sgemm, which on this project's 2-core CPU (AMD, AVX-512) reads the
weights at about a third of the memory bandwidth and gets slower with rows where it should not:
the 211 linear layers of SmolLM2-135M take 32 ms for 1 row, 50 ms for 4 and 57 ms for 16.
oneDNN (bundled with torch's CPU builds) computes the same products from a copy of each weight
reordered once into its blocked layout: 15 ms for 1 row, 16 ms for 4, 18 ms for 8 and 21 ms for 16
(``docs/models.md``), which makes checking 16 proposed tokens cost 1.4 times one decoding step.

Each output row is a dot product of the same weights with the same input row; only the order of
the float additions differs, as it already does between batch shapes. The packed copy costs as
much memory as the weights and is taken on a layer's first call, or for all layers by
`pack_weights`: weights changed in place afterwards are not seen (sdcp never changes a loaded
model's weights).
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import TypeVar

import torch
from torch import nn

__all__ = ["PackedLinear", "pack_weights", "with_packed_linears"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` computed by oneDNN from a prepacked copy of the original's weight.

    ``weight`` and ``bias`` are the original's Parameter objects, so tied weights stay tied and
    the state dict (and with it the weights digest) keeps its names and values.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Packed on first use, not when wrapped: reordering runs parallel operators, and the
        # thread that first runs them owns an OpenMP team; a model then run on another thread
        # brings a second team and runs at half speed on 2 cores (docs/models.md, One OpenMP team).
        output: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.pack(), self.bias, "none", [], "")
        return output

    def pack(self) -> torch.Tensor:
        """The packed weight, made on the first call."""
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self._packed

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_weights(model: nn.Module) -> None:
    """Pack every `PackedLinear` of ``model`` now; call it on the thread that will run the model,
    so that a service's first request does not pay for it (about 0.5 s for SmolLM2)."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.pack()


def with_packed_linears(model: ModuleT) -> ModuleT:
    """A copy of ``model`` whose ``nn.Linear`` layers are `PackedLinear`s on a CPU in float32.

    Only the module objects (and the config) are copied: parameters and buffers are shared with
    ``model``, which is left as it was. On another device or dtype, or with a torch built without
    oneDNN, the copy keeps its ``nn.Linear`` layers.
    """
    tensors = list(chain(model.parameters(), model.buffers()))
    clone = copy.deepcopy(model, memo={id(tensor): tensor for tensor in tensors})
    on_cpu_in_fp32 = all(
        t.device.type == "cpu" and (t.dtype == torch.float32 or not t.is_floating_point()) for t in tensors
    )
    # torch leaves mkldnn.is_available unannotated; it returns a bool.
    if not (on_cpu_in_fp32 and torch.backends.mkldnn.is_available()):  # type: ignore[no-untyped-call]
        return clone
    for parent in list(clone.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return clone
