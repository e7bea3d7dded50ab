"""Thread budgets and the core governor (docs/deploy.md, "Threads and cores")."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sdcp.config import DrafterConfig, InstanceConfig, ServiceConfig, thread_budget
from sdcp.threads import (
    _RUNNABLE_READS,
    CoreGovernor,
    CoreMeter,
    Load,
    LoadWindows,
    _Reader,
    runnable_others,
    usable_cores,
)


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


class ScriptedMeter(CoreMeter):
    """Readings of (cores the others kept busy, cores this process kept busy), one per window, and
    where given when the window began; a window without it began after the one before."""

    def __init__(self, readings: list[tuple[float, float] | tuple[float, float, float] | None]) -> None:
        self.readings = readings
        self.windows = 0

    def busy(self) -> Load | None:
        if not self.readings:
            return None
        reading = self.readings.pop(0)
        if reading is None:
            return None
        self.windows += 1
        return Load(*reading) if len(reading) == 3 else Load(reading[0], reading[1], float(self.windows))


def test_the_meter_subtracts_this_processs_own_time(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    clock = iter([100.0, 102.0])
    # A clock of the meter's own: the process's threads (a load-windows thread among them) keep
    # reading time.monotonic meanwhile.
    meter = CoreMeter(tmp_path, clock=lambda: next(clock))
    ticks = meter._ticks_per_s
    proc.busy += 3 * ticks  # 1.5 cores over 2 s on the machine ...
    proc.own += 1 * ticks  # ... of which 0.5 core is this process
    proc.write()
    assert meter.busy() == pytest.approx((1.0, 0.5, 100.0))


def test_the_meter_says_nothing_without_proc(tmp_path: Path) -> None:
    assert CoreMeter(tmp_path / "missing").busy() is None


@pytest.mark.parametrize(
    ("others", "threads"), [(0.0, 4), (0.5, 4), (0.7, 4), (0.8, 3), (1.0, 3), (2.2, 2), (3.9, 1), (9.0, 1)]
)
def test_the_team_is_the_budget_less_the_cores_others_keep_busy(others: float, threads: int) -> None:
    assert CoreGovernor(4, cores=4, meter=ScriptedMeter([])).team_size(others) == threads


def test_the_team_never_exceeds_the_budget() -> None:
    assert CoreGovernor(2, cores=8, meter=ScriptedMeter([])).team_size(0.0) == 2


def _governor(
    meter: ScriptedMeter,
    probe: ScriptedMeter | None = None,
    clock: list[float] | None = None,
    runnable: Callable[[], int | None] = lambda: None,
) -> CoreGovernor:
    """A governor of two threads on two cores, its windows scripted; its probe of the first work
    after a wait too (by default one that never measures), its clock (by default, frozen) and the
    threads runnable besides its own (by default, unknown)."""
    now = clock if clock is not None else [0.0]
    return CoreGovernor(
        2,
        cores=2,
        meter=meter,
        probe=probe if probe is not None else ScriptedMeter([]),
        clock=lambda: now[0],
        runnable=runnable,
    )


def _steps(governor: CoreGovernor, monkeypatch: pytest.MonkeyPatch, count: int) -> list[int]:
    """apply() ``count`` times, as a busy model thread calls it, each call meeting the next of the
    meter's scripted windows."""
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    return [governor.apply() for _ in range(count)]


def test_a_neighbour_busy_while_the_model_waited_shrinks_the_team_for_its_next_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While this process idled (0.05 cores) another kept a core busy: the long prefill that comes
    # next starts on a team of one, not on two that would wait for each other behind the neighbour.
    meter = ScriptedMeter([(1.0, 0.05), (1.0, 1.0)])
    assert _steps(_governor(meter), monkeypatch, 2) == [1, 1]


def test_the_first_window_of_work_after_a_wait_beside_a_busy_neighbour_sizes_the_team_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another process kept both cores busy while the model waited (a benchmark's other system),
    # then stopped: the first window of work finds the cores free, and the team is whole again at
    # once, not after the average of the two has decayed. Later windows are averaged as before.
    meter = ScriptedMeter([(2.0, 0.05), (0.1, 1.0), (1.4, 1.0), (1.4, 1.0)])
    assert _steps(_governor(meter), monkeypatch, 4) == [1, 2, 2, 1]


def _sizes_at(governor: CoreGovernor, clock: list[float], times: tuple[float, ...]) -> list[int]:
    sizes = []
    for now in times:
        clock[0] = now
        sizes.append(governor.apply())
    return sizes


def test_the_first_twentieth_of_a_second_of_work_after_a_wait_sizes_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process kept both cores busy while the model waited and stopped just before the
    # request: 50 ms into the work the probe finds the cores free and the team is whole again,
    # without waiting for a shared window. The shared window that ends next began in the wait and
    # is left out; the one after it is averaged as before. Seconds later the model waits again
    # beside the busy neighbour: that window is news, and the next work starts on one thread.
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    clock = [0.0]
    windows = ScriptedMeter([(2.0, 0.05, -0.25), None, None, (1.5, 0.6, -0.05), (0.1, 1.9, 0.2), (2.0, 0.05, 9.75)])
    governor = _governor(windows, probe=ScriptedMeter([None, (0.1, 1.0)]), clock=clock)
    assert _sizes_at(governor, clock, (0.0, 0.03, 0.05, 0.2, 0.3, 10.0)) == [1, 1, 2, 2, 2, 1]


def test_a_window_that_ends_while_the_probe_measures_is_left_to_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The shared window that ends 30 ms into the work is mostly wait: the probe's 50 ms decide,
    # and the next window, all work, is averaged with them.
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    clock = [0.0]
    windows = ScriptedMeter([(2.0, 0.05, -0.25), (1.2, 0.5, -0.22), None, (1.9, 1.0, 0.03)])
    governor = _governor(windows, probe=ScriptedMeter([None, (0.1, 1.0)]), clock=clock)
    assert _sizes_at(governor, clock, (0.0, 0.03, 0.05, 0.28)) == [1, 1, 2, 1]


def test_a_probe_over_a_stretch_without_work_or_with_a_wait_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    # Four cores, a neighbour on one while the model waited: a team of three. The probe's first
    # stretch found the model idle, and is not taken in (its neighbour on three cores would
    # leave one thread); the second found the neighbour still on one core.
    clock = [0.0]
    probe = ScriptedMeter([None, (3.0, 0.05), (1.0, 1.0)])
    governor = CoreGovernor(
        4, cores=4, meter=ScriptedMeter([(1.0, 0.05)]), probe=probe, clock=lambda: clock[0], runnable=lambda: None
    )
    assert _sizes_at(governor, clock, (0.0, 0.05, 0.1, 0.15)) == [3, 3, 3, 3]
    assert not governor.provisional
    # A stretch of a second spans a wait between two calls: the probe starts again from there.
    clock = [0.0]
    probe = ScriptedMeter([None, (2.0, 1.0), (0.0, 1.0)])
    governor = _governor(ScriptedMeter([(2.0, 0.05)]), probe=probe, clock=clock)
    assert _sizes_at(governor, clock, (0.0, 1.0, 1.05)) == [1, 1, 2]


def test_a_neighbour_gone_when_the_work_starts_leaves_the_whole_team_in_short_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another process kept both cores busy while the model waited (llama-server, asked in turn),
    # and no thread but the model's is runnable as the work begins: the team is whole at once, its
    # calls still short (provisional) until the probe has measured the first work. A thread of
    # the model's own process, runnable at the first read, is not taken for the neighbour.
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    clock = [0.0]
    reads = iter([1, 0])
    governor = _governor(
        ScriptedMeter([(2.0, 0.05, -0.25)]),
        probe=ScriptedMeter([None, (0.1, 1.0)]),
        clock=clock,
        runnable=lambda: next(reads),
    )
    assert _sizes_at(governor, clock, (0.0,)) == [2]
    assert governor.provisional
    assert _sizes_at(governor, clock, (0.03, 0.05)) == [2, 2]
    assert not governor.provisional


def test_a_neighbour_between_bursts_when_the_work_starts_is_found_by_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The neighbour was not runnable at the start, but the probe finds it on a core: one thread.
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    clock = [0.0]
    governor = _governor(
        ScriptedMeter([(2.0, 0.05, -0.25)]),
        probe=ScriptedMeter([None, (1.0, 1.0)]),
        clock=clock,
        runnable=lambda: 0,
    )
    assert _sizes_at(governor, clock, (0.0, 0.05, 0.1)) == [2, 1, 1]
    assert not governor.provisional


def test_a_neighbour_still_runnable_when_the_work_starts_keeps_the_team_small_read_once_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    reads: list[int] = []

    def runnable() -> int:
        reads.append(1)
        return 1

    clock = [0.0]
    governor = _governor(ScriptedMeter([(1.0, 0.05, -0.25)]), clock=clock, runnable=runnable)
    assert _sizes_at(governor, clock, (0.0, 0.01, 0.02)) == [1, 1, 1]
    assert governor.provisional
    assert len(reads) == _RUNNABLE_READS  # at the work's start, none at its later calls


def test_runnable_others_are_the_machines_runnable_threads_but_this_process_own(tmp_path: Path) -> None:
    (tmp_path / "loadavg").write_text("0.52 0.58 0.59 3/345 12345\n")
    # Without this process's threads to read, the caller alone is its own.
    assert runnable_others(tmp_path) == 2
    tasks = tmp_path / "self" / "task"
    for tid, state in ((101, "R"), (102, "S"), (103, "R")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (sdcp) worker) {state} 1 2 3\n")
    assert runnable_others(tmp_path) == 1
    assert runnable_others(tmp_path / "missing") is None


def test_windows_in_which_the_model_waited_never_grow_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    # A quiet second while the model waited says nothing of what it meets when it works (its
    # verifier, for a drafter, works while it waits): only a window in which it worked grows it back.
    meter = ScriptedMeter([(1.0, 1.0), (0.0, 0.05), (0.0, 0.05), (0.0, 1.9), (0.0, 1.9)])
    assert _steps(_governor(meter), monkeypatch, 5) == [1, 1, 1, 2, 2]


def test_the_shared_windows_are_measured_while_nobody_asks() -> None:
    class Counting(CoreMeter):
        def __init__(self) -> None:
            self.calls = 0
            # Set on the fourth call: the thread stored the third window before it.
            self.stored = threading.Event()

        def busy(self) -> tuple[float, float] | None:
            # Three windows, then /proc cannot be read: the newest stays the third.
            self.calls += 1
            if self.calls == 4:
                self.stored.set()
            return (float(self.calls), 0.0) if self.calls <= 3 else None

    meter = Counting()
    windows = LoadWindows(meter, every_s=0.001)
    first, second = _Reader(windows), _Reader(windows)
    assert first.busy() is None  # the first call starts the measuring
    assert meter.stored.wait(30)
    assert first.busy() == (3.0, 0.0)
    assert first.busy() is None  # each window once to each reader ...
    assert second.busy() == (3.0, 0.0)  # ... whoever read it before


def test_a_neighbour_that_keeps_a_core_busy_while_the_model_works_shrinks_the_team(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The neighbour gets two thirds of a core beside a team of two, and a whole one beside one;
    # once it leaves the team grows back.
    readings: list[tuple[float, float] | None] = [
        (0.1, 1.9),
        (0.9, 1.3),
        (1.0, 1.0),
        (1.0, 1.0),
        (0.1, 1.0),
        (0.1, 1.0),
        (0.1, 1.9),
    ]
    sizes = _steps(_governor(ScriptedMeter(readings)), monkeypatch, 7)
    assert sizes[0] == 2 and 1 in sizes[2:5] and sizes[-1] == 2


def test_slow_passes_still_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under a neighbour one pass can take seconds, so calls are seconds apart: each window counts.
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    governor = _governor(ScriptedMeter([(1.0, 1.2), (1.0, 1.0)]))
    assert [governor.apply() for _ in range(3)] == [1, 1, 1]


def test_apply_sizes_the_calling_threads_team(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def model_thread() -> None:
        governor = _governor(ScriptedMeter([None, (1.5, 1.0)]))
        governor.apply()
        seen.append(torch.get_num_threads())
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
