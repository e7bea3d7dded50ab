"""Achieved transfer bandwidth over a sliding window of recent transfers (drafters' `cache_mbps`)."""

from __future__ import annotations

import threading
import time
from collections import deque


class BandwidthMeter:
    """Sum of bytes over sum of seconds of the transfers of the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 1024) -> None:
        if window_s <= 0 or max_samples <= 0:
            raise ValueError("window_s and max_samples must be positive")
        self._window_s = window_s
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((time.monotonic(), nbytes, max(seconds, 1e-9)))

    def mbps(self) -> float | None:
        """MB/s (10^6 bytes) achieved by recent transfers, or None when none happened recently."""
        horizon = time.monotonic() - self._window_s
        with self._lock:
            while self._samples and self._samples[0][0] < horizon:
                self._samples.popleft()
            total_bytes = sum(sample[1] for sample in self._samples)
            total_s = sum(sample[2] for sample in self._samples)
        if total_bytes == 0:
            return None
        return total_bytes / total_s / 1e6
