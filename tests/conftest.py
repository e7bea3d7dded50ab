"""Fixtures shared by every test directory: a real redis-server on loopback, a guard that fails a
test in which any sdcp component logged an error, and the measured pass costs kept out of the tests
of other rules."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import sdcp.engines.verifier.rounds
import sdcp.protocol.router
from sdcp.threads import limit_native_threads

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker is one of several test processes sharing the cores (`make test`): a torch team of
    # more than one thread would spin at the end of every operator for a thread parked behind another
    # worker (sdcp.threads), which made the torch tests seven times slower than alone. Read before
    # torch is imported; the roles a test starts as processes set their own budget.
    limit_native_threads(1)


def _load_redis_plugin() -> object:
    path = Path(__file__).resolve().parent / "redis_fixture.py"
    spec = importlib.util.spec_from_file_location("redis_fixture", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


redis_url = _load_redis_plugin().redis_url  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def pass_costs_out_of_timing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a verifier measures its passes to cost decides a verdict's m_cap (SDCP 6.5.1) and the
    router's choice between a drafter and the verifier alone (sdcp.protocol.passcost). On a busy
    machine that measurement differs from run to run, so tests of other rules run without it: m_cap
    by load and escalation, the router by round trips, and proposals as long as m_max allows. Tests
    marked ``pass_costs`` test it, on curves they set."""
    if request.node.get_closest_marker("pass_costs"):
        return
    monkeypatch.setattr(
        sdcp.engines.verifier.rounds,
        "speculation_length",
        lambda acceptance, sessions, most, curve=None, *, apart=False: most,
    )
    monkeypatch.setattr(sdcp.protocol.router, "verifier_passes", lambda verifier: None)


@pytest.fixture(autouse=True)
def no_background_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A background task of a node that fails logs an error and nothing else notices: fail the test."""
    yield
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR and r.name.startswith("sdcp")]
    assert not errors, "errors logged during the test: " + "; ".join(r.getMessage() for r in errors)


# The files that took 25 s or more under `make test` (--junitxml's times, two workers), longest
# first, then the other files of the directories whose tests start clusters or run models, then the
# rest. xdist hands whole files to the workers in collection order: the long ones start first and
# the many short files fill the workers' ends, instead of a long file starting last and running alone.
LONGEST_FIRST = (
    "faults/test_faults.py",
    "e2e/test_long_prompts.py",
    "models/test_llamacpp.py",
    "engines/test_prefix_sharing.py",
    "e2e/test_generate.py",
    "e2e/test_generate_redis.py",
    "faults/test_routers.py",
    "e2e/test_client_libraries.py",
    "bench/test_bench.py",
    "test_cli_digest.py",
    "services/test_router_service.py",
    "e2e/test_structured_output.py",
    "e2e/test_up_options.py",
    "e2e/test_openai_api.py",
    "models/test_llamacpp_prefix_cache.py",
    "bench/test_structured.py",
    "conformance/test_own_roles.py",
    "e2e/test_one_process.py",
    "e2e/test_observability.py",
    "services/test_structured_output_service.py",
)
HEAVY_DIRECTORIES = ("e2e", "faults", "models", "engines", "bench", "conformance", "services")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the longest files first (LONGEST_FIRST, HEAVY_DIRECTORIES); each file's tests stay together."""
    tests = Path(__file__).resolve().parent
    if missing := [name for name in LONGEST_FIRST if not (tests / name).is_file()]:
        raise pytest.UsageError(f"LONGEST_FIRST names files that are gone: {', '.join(missing)}")
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}

    def file_rank(item: pytest.Item) -> int:
        name = item.path.relative_to(tests).as_posix()
        if name in rank:
            return rank[name]
        return len(rank) + (0 if name.split("/")[0] in HEAVY_DIRECTORIES else 1)

    items.sort(key=file_rank)
