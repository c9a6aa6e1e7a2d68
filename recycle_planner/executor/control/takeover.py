"""What a coordinator that takes over from a lost one adopts, from the host agents' word.

When the leading coordinator is lost, its successor (`recycle-planner coordinator
--take-over`, run by `failover.coordinate`) starts with nothing in memory, while the workers
still run the generation the lost one decided. Each host agent re-attaches its relay to the
new store and sends what it relayed that the lost coordinator may not have made durable (its
`relay.Journal`: hellos, exits, step reports, losses and checkpoints not yet saved) and an
`Attach`: the newest decision it holds, what the bulletin said of that generation (an abort, a
join request) and its live workers. `Adoption.of` turns those into what the new coordinator
continues from; the durable rest (losses.jsonl, the complete checkpoints) it reads from the
run folder. Nothing here reads a store: a pure function of the records, tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.protocol import Decision


@dataclass(frozen=True)
class Adoption:
    """The running generation (`decision`), whether it was being abandoned (`abort`: the
    reason) or left at a boundary for a join or plan switch (`join`; `switch_at`: the
    iteration its members agreed, if a host heard it), the live workers
    (rank -> incarnation) of the hosts that re-attached, and how far the lost coordinator
    had saved the losses (`saved`, the latest mark any host was told: the journals hold
    every loss report from there on)."""

    decision: Decision
    abort: str | None
    join: bool
    workers: Mapping[int, int]
    saved: int                          # every iteration before it has its loss saved (-1:
                                        # no host was told)
    switch_at: int = -1                 # where its members agreed to leave it (-1: none heard)

    @classmethod
    def of(cls, attaches: Iterable[msg.Attach]) -> "Adoption | None":
        """The newest generation any host holds (a host may not have fetched the latest
        decision yet: the new coordinator posts it again), with what the hosts holding it
        were told of it; None when no host holds a decision (nothing runs: the job starts
        again from its checkpoint)."""
        attaches = list(attaches)
        held = [a for a in attaches if a.gen >= 0]
        if not held:
            return None
        newest = max(held, key=lambda a: a.gen)
        same = [a for a in held if a.gen == newest.gen]
        return cls(Decision.from_json(newest.decision),
                   next((a.abort for a in same if a.abort), None),
                   any(a.join for a in same),
                   {rank: inc for a in attaches for rank, inc in a.workers},
                   max(a.saved for a in attaches), max(a.switch_at for a in same))

    def abort_reason(self) -> str | None:
        """Why the adopted generation is abandoned at once: the lost coordinator was
        abandoning it, or its members had agreed on the lost store where to leave it for a
        join or a plan switch (`SwitchAt`: the first proposal wins). That agreement cannot
        be made again: a worker that had not heard it would propose its own iteration on the
        new store, and the members would leave at different ones. Abandoned, the generation
        ends for all at once (each undoes its iteration, as after any failure) and the next
        decision takes the join in."""
        if self.abort is not None:
            return self.abort
        if self.switch_at >= 0:
            return (f"its members had agreed on the lost coordinator's store to leave it at "
                    f"iteration {self.switch_at}, which the new store cannot agree again")
        return None

    def lost_members(self) -> list[int]:
        """Members of the decision whose process (that incarnation) no host reported live:
        they died while the coordinators changed, or their host did not re-attach."""
        d = self.decision
        return [r for r in d.members if self.workers.get(r) != d.incarnations.get(r, 0)]


def awaited(nodes: Iterable[int], answered: Iterable[int], held: set[int] | None) -> list[int]:
    """The hosts a coordinator taking over still waits for: those that neither re-attached
    nor came back fresh (`answered`), less those whose lease the control store no longer
    holds (`held`: etcd deleted a lost host's key). Every one when the store cannot say
    (`held` None, or empty: no host holds a lease there, as when no node rank was given)."""
    done = set(answered)
    return [n for n in nodes if n not in done and (not held or n in held)]
