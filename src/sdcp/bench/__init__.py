"""`sdcp bench`: greedy and speculative decoding in transformers and llama.cpp, SDCP in process and end to end.

Names are loaded on first use (PEP 562): the tests' Redis helper (sdcp.bench.redis_process) lives
here too, and importing it must not import torch and transformers through the runner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BenchConfig": "runner",
    "run_bench": "runner",
    "BenchInputError": "workloads",
    "load_workloads": "workloads",
}

__all__ = ["BenchConfig", "BenchInputError", "load_workloads", "run_bench"]

if TYPE_CHECKING:
    from sdcp.bench.runner import BenchConfig, run_bench
    from sdcp.bench.workloads import BenchInputError, load_workloads


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sdcp.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"sdcp.bench.{module}"), name)
    globals()[name] = value
    return value
