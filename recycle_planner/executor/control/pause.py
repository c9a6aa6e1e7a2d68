"""Was this process paused? One answer for every part of the control plane that judges silence.

A process that judges another's silence by its own clock (the coordinator its workers' heartbeats,
a host agent its workers' and the coordinator's, a worker its host agent's, a host agent's
backstop its own loop) must not count the time it did not run: stopped (SIGSTOP, a frozen
cgroup, a VM paused) or starved of CPU, it could not hear what was sent meanwhile, so the
silence it sees on waking is its own, not the other party's. Every such judge looks at a
`PauseClock` before it judges, and counts silence from the end of a pause it reports.

The rule: the process was paused between two looks when its CPU time (all threads,
`time.process_time`) lags the wall clock (`time.monotonic`) by more than `PAUSE` seconds over
that span. Neither the wall clock alone ("more than a second between looks") nor the judging
thread's own CPU time tells a pause from a long busy stretch: the coordinator's pass over 8,192
ranks can take over a second, during which it runs and its store thread keeps the hosts'
reports for the next pass, yet the wall rule forgave every worker's silence at each such pass,
and the loop's thread alone spends much of a pass waiting for the GIL and the store, so that
its thread time lagged too and delayed a host's loss to 12.8 s (5.9 s with this rule,
`benchmarks/bench_relay.py --recovery`). A busy process could hear; a stopped or starved one
could not.

Busy counts as hearing only where what the watched party sends is read before its silence is
judged, whichever thread was busy: `Relay.step` reads the workers' sockets before
`Relay.silent` judges them, and the relay's notice thread hears the coordinator beside a loop
that runs only its own Python, which yields the GIL every few milliseconds; the coordinator's
pass refreshes its mail before it judges heartbeats; the host agent's backstop watches its own
loop, which is the busy thread. A worker's training thread may run user code that holds the
GIL for seconds in a C extension, so `link.HostLink` reads its socket and judges its host
agent's silence in one thread, reading first: a judge on a thread of its own would race the
reader after such a stretch and take what waits unread for silence.

The rule is per look, so a caller must look more often than `PAUSE` (the callers look every
0.02 to 0.2 s): an idle process lags the clock by the whole span between two looks. CPU time
counts every thread, so a process computing on n threads at once earns n seconds a second, and
a pause shorter than about (n - 1) look spans beside such a stretch goes unseen; at a tenth of
a second a look, that is a few threads' worth, short of any lease.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

PAUSE = 1.0
"""Seconds by which a process's CPU time may lag the wall clock between two looks before it
counts as paused (stopped or starved) in between: the one home of that threshold."""


class Look(NamedTuple):
    """What a look at the `PauseClock` saw: when it was (the wall clock's seconds) and whether
    the process was paused since the previous look, a pause that ended by `now`."""

    now: float
    paused: bool


class PauseClock:
    """Says, at each look, whether this process was paused since the previous look (see the
    module). `wall` and `cpu` are the clocks it reads (the process's by default)."""

    def __init__(self, wall: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.process_time):
        self._wall, self._cpu = wall, cpu
        self._last = (wall(), cpu())

    def look(self) -> Look:
        (wall, cpu), self._last = self._last, (self._wall(), self._cpu())
        lag = (self._last[0] - wall) - (self._last[1] - cpu)
        return Look(self._last[0], lag > PAUSE)
