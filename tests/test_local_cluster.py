"""Which shape `sdcp up` gives a local cluster when not told (`--one-process` or `--processes`)."""

from __future__ import annotations

import pytest

from sdcp.cluster import DEFAULT_DRAFTERS, one_process_by_default


@pytest.mark.parametrize(
    ("device", "drafters", "one_process"),
    [
        (None, DEFAULT_DRAFTERS, True),
        ("cpu", ("ngram", "suffix"), True),
        ("cuda", DEFAULT_DRAFTERS, False),
        ("cuda:1", DEFAULT_DRAFTERS, False),
        ("mps", DEFAULT_DRAFTERS, False),
        (None, ("ngram", "hf:HuggingFaceTB/SmolLM2-135M"), False),
        ("cpu", ("llamacpp:smollm2-q2k",), False),
    ],
)
def test_one_process_where_the_cpu_runs_the_verifier_and_no_drafter_runs_a_model(
    device: str | None, drafters: tuple[str, ...], one_process: bool
) -> None:
    assert one_process_by_default(device, drafters) is one_process
