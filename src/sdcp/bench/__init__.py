"""`sdcp bench`: target-only, transformers speculative, SDCP in-process and SDCP end to end, side by side."""

from sdcp.bench.runner import BenchConfig, run_bench
from sdcp.bench.workloads import BenchInputError, load_workloads

__all__ = ["BenchConfig", "BenchInputError", "load_workloads", "run_bench"]
