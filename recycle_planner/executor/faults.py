"""Fault injection: make a worker really die (SIGKILL) or hang (SIGSTOP) at a chosen point.

For tests, the demo and chaos drills, never for production training. A fault is written
`RANK:ITERATION:POINT[:ACTION]`:

- POINT `F2` (or I, W, B with an index): just before the worker's third forward (0-based
  index 2) of that iteration, so its peers are mid-forward (or mid-backward) waiting for it;
  `step`: right after its stage's optimizer step of that iteration, before the iteration has
  ended everywhere; `counted`: right after that step is counted (the same moment, except for
  a step checked after it was taken, `data/validation.py`: once checked, inside the worker's
  first forward of the next iteration, before it receives, computes or sends); `allreduce`:
  just before its ALLREDUCE op, which waits for the stage's gradient all-reduce (its buckets
  started during the worker's last W or B, so the peers may already hold the sum);
  `optimizer`: just before the step, after the stage's all-reduce (its peers have stepped; a
  last-stage worker has not yet reported its losses); `start`: at the start of that
  iteration; `recovery`: when it enters recovery from another failure at that iteration or
  later (a failure during recovery); `hold`: at the start of that iteration, if some worker
  is dead, pause until a restarted worker asks to join (makes a re-join happen at a known
  point; no ACTION).
- ACTION `kill` (default): SIGKILL, the process vanishes; `hang`: SIGSTOP, the whole process
  stops answering (caught by the launcher's heartbeat timeout); `stall`: only the training
  thread stops (as in a deadlock in user code) while heartbeats go on (caught by the peers'
  process-group timeout, after which the launcher kills the worker that does not report).
  Whole-host actions, for cluster drills (a host is what a worker's host agent started):
  `host-down`: set the network interface GLOO_SOCKET_IFNAME names down, so that the host
  vanishes without closing a socket; `host-stop`: SIGSTOP the host agent and every worker it
  started; `host-kill`: SIGKILL them.

A fifth field `after-step=R[,R...]` makes the fault wait (at most half the lease) until
workers R have counted their stage's optimizer step of that iteration (a step taken before
its clipping norm was known counts once checked, at the worker's next forward), for a
fault that must land between one stage's step and another's (`3:3:W3:kill:after-step=4,5`:
rank 3 dies in its last weight gradient once ranks 4 and 5 have stepped, so that their
stages must undo the step). Those steps run concurrently with the fault's point, so
without it only timing says which came first.

Only incarnation 0 of a rank is hit: a worker restarted after its fault does not die again.
Before dying, the worker writes the time into the store, so that the launcher can report the
exact time from a kill to recovery.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from recycle_planner.errors import RecycleError

log = logging.getLogger(__name__)

ACTIONS = ("kill", "hang", "stall", "host-down", "host-stop", "host-kill")
_POINT = re.compile(r"(?:(?P<kind>[FIWB])(?P<index>\d+)"
                    r"|(?P<name>step|counted|allreduce|optimizer|start|recovery|hold))")


_AFTER = re.compile(r"after-step=(\d+(?:,\d+)*)")


@dataclass(frozen=True)
class Fault:
    rank: int
    iteration: int
    point: str
    action: str = "kill"
    after_step: tuple[int, ...] = ()   # ranks whose step of `iteration` comes first

    def __str__(self) -> str:
        tail = "" if self.point == "hold" else f":{self.action}"
        if self.after_step:
            tail += ":after-step=" + ",".join(map(str, self.after_step))
        return f"{self.rank}:{self.iteration}:{self.point}{tail}"

    def to_dict(self) -> dict:
        return {"rank": self.rank, "iteration": self.iteration, "point": self.point,
                "action": self.action, "after_step": list(self.after_step)}

    @classmethod
    def from_dict(cls, data: dict) -> "Fault":
        return cls(int(data["rank"]), int(data["iteration"]), str(data["point"]),
                   str(data.get("action", "kill")),
                   tuple(int(r) for r in data.get("after_step", ())))


def parse_fault(text: str) -> Fault:
    parts = text.strip().split(":")
    if len(parts) not in (3, 4, 5) or not parts[0].isdigit() or not parts[1].isdigit():
        raise RecycleError(f"fault {text!r} is not RANK:ITERATION:POINT[:ACTION[:after-step="
                           f"R,...]] (for example 1:2:F0 or 3:4:step:hang)")
    point = parts[2]
    if not _POINT.fullmatch(point):
        raise RecycleError(f"fault {text!r}: point {point!r} is not F<n>, I<n>, W<n>, B<n>, "
                           f"step, counted, allreduce, optimizer, start, recovery or hold")
    action = parts[3] if len(parts) >= 4 else "kill"
    if action not in ACTIONS:
        raise RecycleError(f"fault {text!r}: action {action!r} is not one of "
                           f"{', '.join(ACTIONS)}")
    after: tuple[int, ...] = ()
    if len(parts) == 5:
        match = _AFTER.fullmatch(parts[4])
        if not match:
            raise RecycleError(f"fault {text!r}: {parts[4]!r} is not after-step=R[,R...] "
                               f"(the ranks whose step of iteration {parts[1]} comes first)")
        after = tuple(sorted({int(r) for r in match.group(1).split(",")}))
        if point in ("recovery", "hold"):
            raise RecycleError(f"fault {text!r}: after-step does not apply to point {point}")
        if int(parts[0]) in after:
            raise RecycleError(f"fault {text!r}: rank {parts[0]} cannot wait for its own step")
    return Fault(int(parts[0]), int(parts[1]), point, action, after)


def step_reports(faults: Iterable[Fault]) -> dict[int, tuple[int, ...]]:
    """Which ranks record their step of which iteration (`msg.Stepped`): those a fault of
    that iteration waits for (`after-step`); the control plane retires the records with the
    iteration."""
    reports: dict[int, set[int]] = {}
    for f in faults:
        reports.setdefault(f.iteration, set()).update(f.after_step)
    return {i: tuple(sorted(ranks)) for i, ranks in reports.items() if ranks}


class FaultInjector:
    """The faults of one worker process. `trigger(iteration, point)` is called at each point;
    it is a dict lookup, so a worker without faults pays nothing measurable. `stepped` and
    `have_stepped` talk through the launcher's store: the first records this worker's step
    where another worker's fault waits for it (`after-step`), the second polls for the steps
    a fault waits for, at most `wait` seconds."""

    def __init__(self, faults: Iterable[Fault], rank: int, incarnation: int,
                 announce: Callable[[Fault], None],
                 stepped: Callable[[int], None] | None = None,
                 have_stepped: Callable[[int, tuple[int, ...]], bool] | None = None,
                 wait: float = 0.0):
        faults = list(faults)
        mine = [f for f in faults if f.rank == rank] if incarnation == 0 else []
        self._at = {(f.iteration, f.point): f for f in mine if f.point != "recovery"}
        self._recovery = sorted((f for f in mine if f.point == "recovery"),
                                key=lambda f: f.iteration)
        self._watched = {i for i, ranks in step_reports(faults).items() if rank in ranks}
        if (stepped is None or have_stepped is None) and any(f.after_step for f in faults):
            raise RecycleError("faults with after-step need a store to record steps in")
        self._announce = announce
        self._stepped = stepped
        self._have_stepped = have_stepped
        self._wait = wait
        self.active = bool(mine) or bool(self._watched)

    def at(self, iteration: int, point: str) -> Fault | None:
        return self._at.get((iteration, point))

    def counted(self, iteration: int) -> None:
        """This worker's stage counted its optimizer step of `iteration` (a step checked
        after it was taken, `validation.py`, counts once checked): record it where a fault
        with after-step waits for it, then fire a fault at point `counted`."""
        if not self.active:
            return
        if iteration in self._watched:
            self._stepped(iteration)
        self.trigger(iteration, "counted")

    def trigger(self, iteration: int, point: str) -> None:
        fault = self._at.get((iteration, point))
        if fault is not None and fault.point != "hold":
            if fault.after_step:
                self._await_steps(fault)
            self.fire(fault)

    def _await_steps(self, fault: Fault) -> None:
        deadline = time.monotonic() + self._wait
        while not self._have_stepped(fault.iteration, fault.after_step):
            if time.monotonic() > deadline:
                log.warning("fault %s: ranks %s had not stepped within %.1f s; firing anyway",
                            fault, ",".join(map(str, fault.after_step)), self._wait)
                return
            time.sleep(0.005)

    def on_recovery(self, iteration: int) -> None:
        for fault in self._recovery:
            if iteration >= fault.iteration:
                self.fire(fault)

    def fire(self, fault: Fault) -> None:
        log.warning("injected fault %s: %s now", fault, fault.action)
        try:
            self._announce(fault)
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            if fault.action.startswith("host-"):
                _hit_host(fault.action)
            elif fault.action != "stall":
                os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else
                        signal.SIGSTOP)
            while True:  # hang or stall: the launcher kills this process
                time.sleep(3600)


def _hit_host(action: str) -> None:
    """Take this worker's whole host away: its link, or its agent and workers (the host agent
    is this process's parent; its workers are the agent's children)."""
    if action == "host-down":
        device = os.environ.get("GLOO_SOCKET_IFNAME")
        if not device:
            raise RecycleError("fault action host-down needs GLOO_SOCKET_IFNAME (the link to "
                               "take down)")
        subprocess.run(["ip", "link", "set", "dev", device, "down"], check=True)
        return
    agent = os.getppid()
    pids = [agent] + [int(p) for p in _children(agent) if int(p) != os.getpid()]
    how = signal.SIGKILL if action == "host-kill" else signal.SIGSTOP
    for pid in pids + [os.getpid()]:
        try:
            os.kill(pid, how)
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []
