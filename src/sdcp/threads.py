"""How many cores a process's model work may use: a budget per role, shrunk while other processes
keep cores busy (docs/deploy.md, "Threads and cores").

On CPU, torch runs each operator on an OpenMP team of threads that wait for each other at its end.
When the team has more threads than there are free cores, every operator waits for a thread that
the scheduler has parked behind another process: a one-token pass of SmolLM2 on two cores took
4.5 times as long with one core kept busy by an unrelated process, against 1.4 times with a team
of one. So a budget alone is not enough: ``CoreGovernor`` measures how many cores the rest of the
machine keeps busy and, on the thread that runs the model, sizes the team to the cores left.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

__all__ = [
    "CoreGovernor",
    "CoreMeter",
    "Load",
    "LoadWindows",
    "Meter",
    "limit_native_threads",
    "process_windows",
    "runnable_others",
    "usable_cores",
]

log = logging.getLogger("sdcp.threads")

# A neighbour that stops is seen within a window or two: with windows of a second, a verifier that
# had waited beside a busy neighbour decoded its next 2 to 3 seconds on one thread after the
# neighbour stopped (a third slower a token; docs/performance.md, session 26).
_MEASURE_EVERY_S = 0.25
# The weight of the newest measurement of the other processes' load.
_WEIGHT = 0.5
# A thread beyond the first is kept while the other processes keep at most this many cores busy:
# what they do between two passes of a busy model (requests, answers) does not compete with the
# team, so a core half used by them is still worth a thread; a process that never sleeps takes one.
_SHARE_TOLERATED = 0.75
# A window in which this process used less than this many cores was one in which the model mostly
# waited: what the others did then may not compete with it (a drafter's verifier works while the
# drafter waits for it), so such a window may shrink the team but never grows it. (A gap between
# calls cannot tell: under a neighbour's load one pass can itself take seconds.)
_ACTIVE_CORES = 0.25
# When the model starts work after a wait, the load is measured again over this first stretch of it
# rather than after a whole window: the estimate it starts from was made while it waited, and a
# neighbour busy then (a benchmark's other system) may have stopped just before. /proc/stat counts
# in hundredths of a second (a busy loop of 50 ms read 5 ticks, ten times out of ten), so a
# twentieth of a second tells a neighbour's busy core (5 ticks) from a quiet one (0 or 1).
_FIRST_WORK_S = 0.05
# A probe's stretch longer than this spans a wait between two calls (or one call too long to size
# in time): it says nothing of the first work, and the probe starts again.
_PROBE_LONGEST_S = 4 * _FIRST_WORK_S
# Before that first stretch is measured, the threads runnable at its start say at once whether the
# neighbour seen during the wait is still at it: read this many times, this far apart, since one of
# this process's own threads may be finishing its turn. Beside a neighbour that stopped just before
# (a benchmark's other system asked in turn), a first token's prefill ran on one thread in short
# calls: 70 ms for 12 tokens where two threads take 35 (docs/performance.md, session 32).
_RUNNABLE_READS = 6
_RUNNABLE_SPACING_S = 0.0004


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def limit_native_threads(threads: int) -> None:
    """Size the OpenMP and MKL thread pools before torch is imported (they read these once)."""
    if threads < 1:
        raise ValueError(f"a thread budget is at least 1, got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)


class Load(NamedTuple):
    """Cores the other processes (``others``) and this one (``own``) kept busy on average over a
    stretch of time that began at ``since`` (time.monotonic)."""

    others: float
    own: float
    since: float


class CoreMeter:
    """How many cores processes other than this one keep busy, from ``/proc/stat`` and this
    process's own CPU time (Linux); None where those cannot be read."""

    def __init__(self, proc: Path = Path("/proc"), clock: Callable[[], float] = time.monotonic) -> None:
        self._proc = proc
        self._clock = clock
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def busy(self) -> Load | None:
        """The load since the previous call."""
        sample = self._sample()
        previous, self._last = self._last, sample
        if sample is None or previous is None:
            return None
        wall = sample[0] - previous[0]
        if wall <= 0:
            return None
        own = (sample[2] - previous[2]) / self._ticks_per_s / wall
        others = (sample[1] - previous[1]) / self._ticks_per_s / wall - own
        return Load(max(0.0, others), own, previous[0])

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            fields = (self._proc / "stat").read_text(encoding="ascii").split("\n", 1)[0].split()
            # user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
            values = [int(v) for v in fields[1:9]]
            busy = sum(values) - values[3] - values[4]
            own_fields = (self._proc / "self" / "stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
            # After the command name: state is field 3, utime and stime fields 14 and 15.
            own = int(own_fields[11]) + int(own_fields[12])
        except (OSError, ValueError, IndexError):
            return None
        return self._clock(), busy, own


class LoadWindows:
    """``CoreMeter`` windows of a quarter second each, measured on a daemon thread whether or not
    the model works, so that the first pass after an idle spell meets the load of the quarter second
    before it, not the average since the last pass (minutes, perhaps, in which a neighbour only just
    started)."""

    def __init__(self, meter: CoreMeter, every_s: float = _MEASURE_EVERY_S) -> None:
        self._meter = meter
        self._every_s = every_s
        self._lock = threading.Lock()
        self._newest: Load | None = None
        self._started = False

    def newest(self) -> Load | None:
        """The newest window (a new object each window), None before the first; the first call
        starts the measuring."""
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self._measure, name="sdcp-load-windows", daemon=True).start()
            return self._newest

    def _measure(self) -> None:
        while True:
            time.sleep(self._every_s)
            window = self._meter.busy()
            if window is not None:
                with self._lock:
                    self._newest = window


_process_windows: LoadWindows | None = None
_process_windows_lock = threading.Lock()


def process_windows() -> LoadWindows:
    """The load windows of this process's host, one sampling thread however many governors read it."""
    global _process_windows
    with _process_windows_lock:
        if _process_windows is None:
            _process_windows = LoadWindows(CoreMeter())
        return _process_windows


class _Reader:
    """One governor's view of the shared windows: each window once."""

    def __init__(self, windows: LoadWindows) -> None:
        self._windows = windows
        self._seen: Load | None = None

    def busy(self) -> Load | None:
        newest = self._windows.newest()
        if newest is None or newest is self._seen:
            return None
        self._seen = newest
        return newest


def runnable_others(proc: Path = Path("/proc")) -> int | None:
    """Threads of other processes runnable on the machine now: ``/proc/loadavg``'s runnable
    threads less this process's own (the calling one, and its event loop answering the request
    whose work begins: taken for a neighbour, they kept the team at one thread for the first
    work's whole probe after every wait beside a busy neighbour). None where it cannot be read."""
    try:
        runnable = int((proc / "loadavg").read_text(encoding="ascii").split()[3].split("/", 1)[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, runnable - max(1, _own_runnable(proc)))


def _own_runnable(proc: Path) -> int:
    """This process's threads in state R (``/proc/self/task/*/stat``); 0 where none can be read."""
    count = 0
    for stat in (proc / "self" / "task").glob("*/stat"):
        try:
            # The state follows the command name, which is in parentheses and may hold spaces.
            state = stat.read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        count += state == "R"
    return count


class Meter(Protocol):
    def busy(self) -> Load | None:
        """The load of a window not seen before, if there is one."""


class CoreGovernor:
    """The threads of the model work that follows each call of ``apply``: the budget, less the
    cores other processes keep busy (a core counts as free unless they keep more than
    ``_SHARE_TOLERATED`` of it busy), as measured while the model works or, where more, while it
    waited. ``set_threads`` applies a team size (default: torch's OpenMP team of the calling
    thread; a llama.cpp target's threads)."""

    def __init__(
        self,
        budget: int,
        *,
        cores: int | None = None,
        meter: Meter | None = None,
        probe: Meter | None = None,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        runnable: Callable[[], int | None] = runnable_others,
    ) -> None:
        if budget < 1:
            raise ValueError(f"a thread budget is at least 1, got {budget}")
        self.budget = budget
        self._set_threads = set_threads if set_threads is not None else _set_torch_threads
        self.cores = cores if cores is not None else usable_cores()
        self._meter = meter if meter is not None else _Reader(process_windows())
        # The governor's own meter of the first stretch of work after a wait, and when that began.
        self._probe = probe if probe is not None else CoreMeter()
        self._clock = clock
        self._runnable = runnable
        self._probe_since: float | None = None
        # When the stretch of the newest measurement taken in began.
        self._measured_since = -math.inf
        self._others: float | None = None
        # Whether the newest window taken in was one in which the model worked.
        self._worked = False
        self.threads = budget
        self._applied: int | None = None
        # The wait (its newest window's start) after which the runnable threads were read, and
        # whether they grew the team.
        self._runnable_read_after: float | None = None
        self._grown_on_runnable = False

    @property
    def provisional(self) -> bool:
        """Whether the team is sized on load measured while the model waited (smaller than the
        budget), or on the threads runnable as the work began, and the first work after the wait
        has not been measured yet: long work should come back between short calls (``apply`` may
        resize the team then)."""
        return not self._worked and (self.threads < self.budget or self._grown_on_runnable)

    def team_size(self, others_busy: float) -> int:
        return max(1, min(self.budget, math.floor(self.cores - others_busy + _SHARE_TOLERATED)))

    def apply(self) -> int:
        """Take in the window measured since the last call, if any, and the first stretch of work
        after a wait once it is measured; set the calling thread's team size; return it."""
        window = self._meter.busy()
        # A window that began before the newest measurement taken in, or before a probe under way,
        # is older news: it holds the wait that the probe's stretch follows.
        probing_since = self._probe_since if self._probe_since is not None else -math.inf
        if window is not None and window.since >= max(self._measured_since, probing_since):
            self._take_in(window)
        first = self._first_work()
        if first is not None:
            self._take_in(first)
        if self.provisional and self._runnable_read_after != self._measured_since:
            self._runnable_read_after = self._measured_since
            self._grow_on_runnable()
        if self.threads != self._applied:
            self._set_threads(self.threads)
            if self._applied is not None:
                log.info(
                    "model threads %d -> %d (other processes busy on %.1f cores)",
                    self._applied,
                    self.threads,
                    self._others or 0.0,
                )
            self._applied = self.threads
        return self.threads

    def _take_in(self, load: Load) -> None:
        others = load.others
        working = load.own >= _ACTIVE_CORES
        if working and self._worked and self._others is not None:
            self._others += _WEIGHT * (others - self._others)
        elif working:
            # The first window of work says what the model meets now; the estimate it replaces
            # was made while the model waited. A neighbour that stopped just before a request
            # (a benchmark's other system) had the average keep the team at one thread for
            # 0.6-0.9 s of it (docs/performance.md, session 27).
            self._others = others
        elif self._others is None or others > self._others:
            # A neighbour that kept cores busy while the model waited keeps them busy when it
            # works: a long prefill arriving then must not start on a team twice too large.
            self._others = others
        self._worked = working
        self._measured_since = load.since
        self._grown_on_runnable = False
        self.threads = self.team_size(self._others)

    def _grow_on_runnable(self) -> None:
        """Grow a team that a wait's load shrank where fewer threads are runnable now: the
        neighbour stopped. The probe of the first work still measures it (`_first_work`), in short
        calls (`provisional`), and shrinks the team again if the neighbour was only between bursts."""
        fewest: int | None = None
        for read in range(_RUNNABLE_READS):
            if read:
                time.sleep(_RUNNABLE_SPACING_S)
            others = self._runnable()
            if others is None:
                return
            fewest = others if fewest is None else min(fewest, others)
            if fewest == 0:
                break
        assert fewest is not None
        size = self.team_size(fewest)
        if size > self.threads:
            self.threads = size
            self._grown_on_runnable = True

    def _first_work(self) -> Load | None:
        """The load over the first ``_FIRST_WORK_S`` of work after a wait, once measured: a probe
        runs whenever the estimate was last made while the model waited. One over a stretch in
        which the model did not work says nothing, and one over a stretch longer than
        ``_PROBE_LONGEST_S`` spans a wait; either starts again."""
        if self._worked:
            self._probe_since = None
            return None
        now = self._clock()
        if self._probe_since is None or now - self._probe_since > _PROBE_LONGEST_S:
            self._probe.busy()
            self._probe_since = now
            return None
        if now - self._probe_since < _FIRST_WORK_S:
            return None
        measured = self._probe.busy()
        if measured is None or measured.own < _ACTIVE_CORES:
            self._probe_since = now
            return None
        since, self._probe_since = self._probe_since, None
        return Load(measured.others, measured.own, since)


def _set_torch_threads(threads: int) -> None:
    import torch  # only the roles that run a model get here

    # OpenMP's team size is a setting of the calling thread: the model's own thread.
    torch.set_num_threads(threads)
