"""Thread budgets and the core governor (docs/deploy.md, "Threads and cores")."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from sdcp.services.config import DrafterConfig, InstanceConfig, ServiceConfig, thread_budget
from sdcp.threads import CoreGovernor, CoreMeter, usable_cores


class FakeProc:
    """A /proc with a machine-wide busy count and this process's own CPU time, in ticks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "self").mkdir(parents=True)
        self.busy = 0
        self.own = 0
        self.write()

    def write(self) -> None:
        # user nice system idle iowait irq softirq steal
        (self.root / "stat").write_text(f"cpu  {self.busy} 0 0 5000 7 0 0 0 0 0\ncpu0 1 2 3\n")
        own = " ".join(["S"] + ["0"] * 10 + [str(self.own), "0"] + ["0"] * 30)
        (self.root / "self" / "stat").write_text(f"42 (python (test)) {own}\n")


class FixedMeter(CoreMeter):
    def __init__(self, others: float | None) -> None:
        self.others = others

    def others_busy(self) -> float | None:
        return self.others


def test_the_meter_subtracts_this_processs_own_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = FakeProc(tmp_path)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr("sdcp.threads.time.monotonic", lambda: next(clock))
    meter = CoreMeter(tmp_path)
    ticks = meter._ticks_per_s
    proc.busy += 3 * ticks  # 1.5 cores over 2 s on the machine ...
    proc.own += 1 * ticks  # ... of which 0.5 core is this process
    proc.write()
    assert meter.others_busy() == pytest.approx(1.0)


def test_the_meter_says_nothing_without_proc(tmp_path: Path) -> None:
    assert CoreMeter(tmp_path / "missing").others_busy() is None


@pytest.mark.parametrize(
    ("others", "threads"), [(0.0, 4), (0.5, 4), (0.7, 4), (0.8, 3), (1.0, 3), (2.2, 2), (3.9, 1), (9.0, 1)]
)
def test_the_team_is_the_budget_less_the_cores_others_keep_busy(others: float, threads: int) -> None:
    assert CoreGovernor(4, cores=4, meter=FixedMeter(None)).team_size(others) == threads


def test_the_team_never_exceeds_the_budget() -> None:
    assert CoreGovernor(2, cores=8, meter=FixedMeter(None)).team_size(0.0) == 2


class ScriptedMeter(CoreMeter):
    def __init__(self, readings: list[float]) -> None:
        self.readings = readings
        self.calls = 0

    def others_busy(self) -> float | None:
        self.calls += 1
        return self.readings.pop(0)


def test_windows_in_which_the_model_idled_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr("sdcp.threads.time.monotonic", lambda: now[0])
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    meter = ScriptedMeter([2.0, 0.2, 2.0])
    governor = CoreGovernor(2, cores=2, meter=meter)
    assert governor.apply() == 2  # the first work after an idle start opens a window
    now[0] = 0.5
    governor.apply()
    now[0] = 1.1
    assert governor.apply() == 2  # others busy on 0.2 cores while the model worked
    now[0] = 5.0  # idle for 3.9 s: whatever ran meanwhile did not compete with the model
    assert governor.apply() == 2 and meter.calls == 3


def test_a_neighbour_that_keeps_a_core_busy_while_the_model_works_shrinks_the_team(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    monkeypatch.setattr("sdcp.threads.time.monotonic", lambda: now[0])
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    governor = CoreGovernor(2, cores=2, meter=ScriptedMeter([0.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1]))
    sizes = []
    for step in range(1, 14):
        now[0] = step * 0.5
        sizes.append(governor.apply())
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2


def test_apply_sizes_the_calling_threads_team(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    now = [0.0]
    monkeypatch.setattr("sdcp.threads.time.monotonic", lambda: now[0])

    def model_thread() -> None:
        governor = CoreGovernor(2, cores=2, meter=FixedMeter(1.5))
        governor.apply()
        seen.append(torch.get_num_threads())
        now[0] = 1.0
        governor.apply()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=model_thread)
    worker.start()
    worker.join()
    assert seen == [2, 1]


def test_roles_without_a_model_get_one_thread(tmp_path: Path) -> None:
    instance = InstanceConfig(uri="https://127.0.0.1:1", cert=tmp_path, key=tmp_path, ca=tmp_path)
    plain = ServiceConfig(instance=instance)
    assert thread_budget(plain, "router") == thread_budget(plain, "gateway") == 1
    assert thread_budget(plain, "drafter") == 1  # the default drafter is prompt lookup
    assert thread_budget(plain, "verifier") == usable_cores()
    model_drafter = ServiceConfig(instance=instance, drafter=DrafterConfig(model="hf:smollm2"))
    assert thread_budget(model_drafter, "drafter") == usable_cores()
    pinned = ServiceConfig(
        instance=InstanceConfig(uri="https://127.0.0.1:1", cert=tmp_path, key=tmp_path, ca=tmp_path, threads=3)
    )
    assert thread_budget(pinned, "verifier") == thread_budget(pinned, "router") == 3
