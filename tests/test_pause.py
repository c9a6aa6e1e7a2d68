"""`pause.PauseClock`: whether this process was paused (stopped or starved) between two looks,
judged by its CPU time lagging the wall clock, on a fake pair of clocks. (The callers' drills,
which SIGSTOP real processes, are in tests/test_host_relay.py, tests/test_cluster.py and
tests/test_control_failover_training.py.)"""

from __future__ import annotations

import pytest

from recycle_planner.executor.control.pause import PAUSE, PauseClock


class _Clocks:
    """A wall clock and a process CPU clock that the test moves."""

    def __init__(self) -> None:
        self.wall, self.cpu = 100.0, 3.0

    def clock(self) -> PauseClock:
        return PauseClock(wall=lambda: self.wall, cpu=lambda: self.cpu)

    def run(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.mark.parametrize("wall, cpu, paused", [
    (3.0, 0.0, True),     # stopped (SIGSTOP) for 3 s: no CPU time at all
    (3.0, 0.5, True),     # starved: ran a sixth of the time
    (3.0, 3.0, False),    # one thread busy the whole time: it could hear
    (3.0, 5.9, False),    # two threads busy at once
    (3.0, 2.1, False),    # busy, and out of the CPU for less than PAUSE
    (0.1, 0.002, False),  # a normal look a tenth of a second after the last
    (PAUSE, 0.0, False),  # idle for exactly the threshold: not over it
])
def test_a_stopped_or_starved_process_was_paused_a_busy_or_normal_one_was_not(wall, cpu, paused):
    clocks = _Clocks()
    clock = clocks.clock()
    clocks.run(wall, cpu)
    look = clock.look()
    assert look.paused is paused
    assert look.now == clocks.wall


def test_each_look_judges_only_the_span_since_the_previous_one():
    """Idle looks half a second apart never add up to a pause; a stop is reported by the one
    look after it, counted from that look's time; a long busy stretch after it is none."""
    clocks = _Clocks()
    clock = clocks.clock()
    for _ in range(10):
        clocks.run(0.5, 0.001)
        assert not clock.look().paused
    clocks.run(2.0, 0.0)
    now, paused = clock.look()
    assert paused and now == clocks.wall
    clocks.run(0.1, 0.0)
    assert not clock.look().paused
    clocks.run(8.0, 8.0)
    assert not clock.look().paused

