"""Which shape `sdcp up` gives a local cluster when not told (`--one-process` or `--processes`), and
an instance's log once it runs alone after running in one process."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import pytest

from sdcp.cluster import DEFAULT_DRAFTERS, LocalCluster, one_process_by_default


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


def test_an_instance_started_alone_after_one_process_writes_a_log_of_its_own(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    logs = cluster.root / "logs"
    logs.mkdir(parents=True)
    together = logs / "together.log"
    together.write_text("the process of every instance\n")
    # As `_spawn_together` left it: the instance's log names the process's.
    (logs / "router.log").symlink_to(together.name)
    pid = cluster._start_process(["--version"], logs / "router.log")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (logs / "router.log").is_symlink()
    assert (logs / "router.log").read_text().strip() == version("sdcp")
    assert together.read_text() == "the process of every instance\n"
