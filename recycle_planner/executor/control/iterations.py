"""What the launcher (or coordinator) keeps of the iterations a run trains: a window, not the run.

Every rank reports the end of every iteration (`IterationDone`) and every last-stage worker all
of the iteration's micro-batch losses (`Losses`); kept for the whole run, that is iterations x
ranks records (hundreds of millions at 8,192 ranks and 100,000 iterations). They are needed
only until the iteration is over for good:

- an iteration's losses are **final** once the next iteration's are all known (its forwards
  ran after every stage's step of it, which the step gate confirmed, so it is never redone);
  they are then appended to the run folder's `losses.jsonl` at once, with the iteration's end
  as far as its ranks reported it (a killed coordinator writes no result; the resumed run, a
  coordinator taking over and the result read them back from there: `runfolder.LossRow`);
- every live member sent the iteration's end before its next forwards, so once its losses are
  final its ends are on their way: they have arrived within a lease (a host reports at least
  every heartbeat, and one silent for a lease is lost). Then the iteration is **retired**: its
  end time and generation go into two compact arrays (what the result reports per
  iteration: 12 bytes each), its row is written again if a late report moved its end, and
  its records leave the mail (`Mail.forget`: from memory, and their keys from the
  launcher's store).

The iterations before the attempt's start (a resumed run's, or those a lost coordinator had
saved) take their end from their rows, so that every run's result has every iteration's end.

So the records held cover the iterations of the last lease or so, whatever the run's length
(`tests/test_mail_contract.py`, on both mails; `benchmarks/bench_relay.py --memory` measures
it)."""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.mail import Mail
from recycle_planner.executor.control.runfolder import LossRow, RunFolder


class IterationLog:
    """The iterations of one attempt from `start` (its first decision's restart): their losses
    saved as they become final, their records dropped a `linger` (the lease) later.
    `pipelines` x `stages` workers, `microbatches` losses per pipeline; `stepped`: the ranks
    that record their step of an iteration for an injected fault (`faults.step_reports`),
    whose records are retired with the iteration's."""

    def __init__(self, mail: Mail, folder: RunFolder, pipelines: int, stages: int,
                 microbatches: int, start: int, linger: float,
                 stepped: Mapping[int, Sequence[int]] | None = None):
        self.mail, self.folder = mail, folder
        self.world, self.stages = pipelines * stages, stages
        self.need = pipelines * microbatches
        self.last = [d * stages + stages - 1 for d in range(pipelines)]
        self.linger = linger
        self.stepped = dict(stepped or {})
        self.next_loss = start              # the next iteration to save to losses.jsonl
        self.complete: set[int] = set()     # iterations from it on whose losses all arrived
        self.partial: dict[int, _Coverage] = {}         # the others': what arrived so far
        self.saved: deque[tuple[int, float]] = deque()   # (iteration, when saved), not retired
        self.rows: dict[int, LossRow] = {}               # their rows as saved
        rows = folder.saved_rows()                       # the iterations before `start`
        self.ends = array("d", [_nan(rows[i].end if i in rows else None)
                                for i in range(start)])  # per retired iteration: its end
        self.gens = array("i", [-1] * start)             # and the generation that ended it

    @property
    def retired(self) -> int:
        """Iterations before this one hold no records any more."""
        return len(self.ends)

    def save(self, now: float, upto: int | None = None) -> None:
        """Append to losses.jsonl every iteration whose D*M losses are final. Every last-stage
        worker reports all of them after the losses' all-reduce, so one report is usually
        enough; an attempt abandoned after its losses were known is redone, and its redo's
        report replaces it (so they are read again when saved). What a pass learned is kept
        for the next (`_complete`), so that a pass waiting for the next iteration reads only
        the reports that arrived since. At the end (`upto`): every iteration the run
        completed."""
        rows = []
        while upto is None or self.next_loss < upto:
            i = self.next_loss
            if not self._complete(i) or upto is None and not self._complete(i + 1):
                break
            values = self.losses(i)  # once per iteration: a redo's report may be newer
            if len(values) < self.need:
                self.complete.discard(i)
                break
            end, _ = self._end(i)
            row = LossRow(i, sum(v for _, v in values.values()) / len(values),
                          max(g for g, _ in values.values()), self.folder.record.attempt,
                          None if math.isnan(end) else end)
            rows.append(row)
            self.rows[i] = row
            self.saved.append((i, now))
            self.complete.discard(i)
            self.partial.pop(i, None)
            self.next_loss += 1
        self.folder.add_losses(rows)

    def _complete(self, i: int) -> bool:
        """Whether every loss of iteration i arrived. Once they all have, the next iteration's
        forwards ran, which stays true; until then what the passes found is kept
        (`_Coverage`): a pass reads only the last-stage ranks whose report it has not read,
        and none while no `Losses` arrived since the last look (`Mail.arrivals`). A report
        is never taken back (a redo's replaces it, covering the same micro-batches), so the
        losses covered only grow: reading each rank's first report is enough to know."""
        if i in self.complete:
            return True
        part = self.partial.setdefault(i, _Coverage(list(self.last)))
        arrived = self.mail.arrivals(msg.Losses)
        if arrived is not None and arrived == part.seen:
            return False
        part.seen = arrived
        unread = []
        for rank in part.unread:
            rec = (None if len(part.covered) >= self.need
                   else self.mail.get(msg.Losses, iteration=i, rank=rank))
            if rec is None:
                unread.append(rank)
            else:
                part.covered.update((p, m) for p, m, _ in rec.losses)
        part.unread = unread
        if len(part.covered) >= self.need:
            self.complete.add(i)
            del self.partial[i]
        return i in self.complete

    def retire(self, now: float) -> None:
        """Drop the records of the iterations saved at least `linger` ago."""
        moved = []
        while self.saved and now - self.saved[0][1] >= self.linger:
            i, _ = self.saved.popleft()
            moved += self._take_end(i)
            self.mail.forget(i, self._keys(i))
        self.folder.add_losses(moved)

    def losses(self, i: int) -> dict[tuple[int, int], tuple[int, float]]:
        """Iteration i's micro-batch losses as the last stage reported them: (pipeline,
        micro-batch) -> (generation, loss), the latest generation's report winning; stops
        reading once it has them all."""
        values: dict[tuple[int, int], tuple[int, float]] = {}
        for rank in self.last:
            if len(values) >= self.need:
                break
            rec = self.mail.get(msg.Losses, iteration=i, rank=rank)
            if rec is not None:
                for p, m, v in rec.losses:
                    if (p, m) not in values or values[(p, m)][0] <= rec.gen:
                        values[(p, m)] = (rec.gen, v)
        return values

    def ends_upto(self, n: int) -> tuple[list[float | None], list[int]]:
        """The end time (None: not reported in this attempt) and the generation (-1: none)
        of iterations 0..n-1: the retired ones' from the arrays, the others' from the mail."""
        moved = []
        for i in range(self.retired, n):
            moved += self._take_end(i)
        self.folder.add_losses(moved)
        return ([None if math.isnan(t) else t for t in self.ends[:n]], list(self.gens[:n]))

    def _take_end(self, i: int) -> list[LossRow]:
        """Move iteration i's end into the arrays; its row again (to append) if the end
        moved since the row was saved (a rank's report came after the losses were final)."""
        assert i == len(self.ends), (i, len(self.ends))
        end, gen = self._end(i)
        self.ends.append(end)
        self.gens.append(gen)
        row = self.rows.pop(i, None)
        if row is None or math.isnan(end) or row.end == end:
            return []
        return [replace(row, end=end)]

    def _end(self, i: int) -> tuple[float, int]:
        """Iteration i's end as its ranks reported it so far (the latest; NaN: none) and the
        generation that ended it (-1: none)."""
        end, gen = math.nan, -1
        for done in self.mail.get_many(msg.IterationDone, [{"iteration": i, "rank": r}
                                                           for r in range(self.world)]):
            if done is not None:
                end = done.t if math.isnan(end) else max(end, done.t)
                gen = max(gen, done.gen)
        return end, gen

    def _keys(self, i: int) -> Sequence[str]:
        """Every key iteration i's records can have."""
        return ([msg.IterationDone.key_for(iteration=i, rank=r) for r in range(self.world)]
                + [msg.Losses.key_for(iteration=i, rank=r) for r in self.last]
                + [msg.CheckpointWritten.key_for(iteration=i, stage=s)
                   for s in range(self.stages)]
                + [msg.Stepped.key_for(iteration=i, rank=r) for r in self.stepped.get(i, ())])


@dataclass
class _Coverage:
    """What the passes found of an iteration whose losses have not all arrived: the
    (pipeline, micro-batch) pairs reported, the last-stage ranks whose report was not there
    yet, and `Mail.arrivals(Losses)` when they last looked."""

    unread: list[int]
    covered: set[tuple[int, int]] = field(default_factory=set)
    seen: int | None = None


def _nan(end: float | None) -> float:
    return math.nan if end is None else end
