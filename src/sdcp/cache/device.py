"""Accelerator-memory tier: objects held as CUDA byte tensors, used only when CUDA is present.

torch is imported lazily so that the MLC never needs it otherwise (CI has no GPU).
"""

from __future__ import annotations

from typing import Any

from sdcp.cache.memory import LruBytes


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class DeviceTier(LruBytes):
    """LRU of uint8 tensors on `device` (a CUDA device in service; tests may pass "cpu")."""

    def __init__(self, capacity_bytes: int, device: str = "cuda") -> None:
        import torch

        super().__init__("device", capacity_bytes)
        self._torch: Any = torch
        self.device = torch.device(device)

    def _hold(self, data: bytes) -> object:
        if not data:  # torch.frombuffer refuses an empty buffer
            return self._torch.empty(0, dtype=self._torch.uint8, device=self.device)
        host = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        return host.to(self.device)

    def _bytes(self, held: object) -> bytes:
        return held.cpu().numpy().tobytes()  # type: ignore[attr-defined, no-any-return]
