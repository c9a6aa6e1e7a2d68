"""What a coordinator that takes over from a lost one adopts, from the host agents' word.

When the leading coordinator is lost, its successor (`recycle-planner coordinator
--take-over`, run by `failover.coordinate`) starts with nothing in memory, while the workers
still run the generation the lost one decided. Each host agent re-attaches its relay to the
new store and sends what it relayed that the lost coordinator may not have made durable (its
`relay.Journal`: hellos, exits, step reports, losses and checkpoints not yet saved) and an
`Attach`: the newest decision it holds, what the bulletin said of that generation (an abort, a
join request) and its live workers. `Adoption.of` turns those into what the new coordinator
continues from; the durable rest (losses.jsonl, the complete checkpoints) it reads from the
run folder. Whom it waits for before adopting is `Waiting`'s decision. Nothing here reads a
store: pure functions of the records, tested on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Iterable, Mapping

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.control.runfolder import LossRow


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

    def saving_from(self, rows: Mapping[int, LossRow], lost: Container[int]) -> int:
        """The first iteration whose losses the new coordinator saves: from the mark the
        hosts were told (else the generation's restart), past the rows that the lost
        coordinators (the run folder's attempts `lost`: the one it takes over from and
        those that one took over from, `RunRecord.taken_over`) appended from there on. A
        coordinator saves an iteration only once it is final, then tells the hosts at most
        every quarter lease, so its last rows are often ahead of the mark; saving them again
        would write an iteration twice (seen at 1,024 ranks). A lost coordinator that had
        told the hosts no mark of its own leaves them its predecessor's, behind both their
        rows. A row of another attempt (an earlier run's, or one a stopped worker wrote) is
        not this generation's."""
        i = self.saved if self.saved >= 0 else self.decision.restart
        while (row := rows.get(i)) is not None and row.attempt in lost:
            i += 1
        return i

    def lost_members(self) -> list[int]:
        """Members of the decision whose process (that incarnation) no host reported live:
        they died while the coordinators changed, or their host did not re-attach."""
        d = self.decision
        return [r for r in d.members if self.workers.get(r) != d.incarnations.get(r, 0)]


@dataclass(frozen=True)
class Waiting:
    """Whom a coordinator taking over still waits for (`awaited`), and whom it gives up on
    (`gone`, `late`: their workers are dead to it), `waited` seconds after it started.

    A host that neither re-attached nor came back fresh (`answered`) is alive while etcd
    holds its host lease (`held`, `failover.HostLeases`: the host's own wrapper renews it,
    and etcd deletes it a lease after the host is lost). Such a host is waited for, however
    slowly it re-attaches (a new store's accepts are serial: at 1,024 hosts the last one
    re-attaches seconds after the first), up to `bound` (the rendezvous timeout, after which
    its own agent gives up on finding a coordinator and stops its workers). Declaring it
    dead sooner would turn a slow re-attach into lost workers and a new generation without
    them (three leases did, at 128 ranks). A host whose lease is gone is lost at once
    (`gone`). When etcd cannot say (`held` None, or empty: no host holds a lease there, as
    when no node rank was given), nothing tells a slow host from a lost one: a host absent
    for three leases is taken for lost."""

    awaited: tuple[int, ...]
    gone: tuple[int, ...]          # their host lease is gone: lost, not waited for
    late: tuple[int, ...]          # alive (or unknown), but not there within `limit`
    limit: float                   # seconds: how long a host not known lost is waited for

    @classmethod
    def of(cls, nodes: Iterable[int], answered: Iterable[int], held: set[int] | None,
           waited: float, lease: float, bound: float) -> "Waiting":
        done = set(answered)
        missing = [n for n in nodes if n not in done]
        known = bool(held)
        gone = tuple(n for n in missing if known and n not in held)
        alive = [n for n in missing if n not in gone]
        limit = bound if known else 3 * lease
        if waited < limit:
            return cls(tuple(alive), gone, (), limit)
        return cls((), gone, tuple(alive), limit)

    def said(self) -> str:
        """The hosts given up on, and why (for the take-over event; "" when none)."""
        return ((f"; hosts {list(self.gone)} hold no lease on etcd (lost), not waited for"
                 if self.gone else "")
                + (f"; hosts {list(self.late)} did not re-attach within {self.limit:g} s "
                   f"(lost)" if self.late else ""))
