"""The coordinator's iteration log (`iterations.IterationLog`) over a mail held in a dict: what
it writes to losses.jsonl, what it reads back when an attempt starts later in the run (a
resume, a coordinator taking over), and how much it reads per pass. The two real mails share
their contract in `test_mail_contract.py`; here the log's own rules, without a store."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pytest

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.iterations import IterationLog
from recycle_planner.executor.control.runfolder import (LossRow, append_losses, claim,
                                                        read_losses, read_rows)

D, S, M = 2, 2, 2            # pipelines, stages, micro-batches
LAST = [1, 3]                # the last stage's ranks


class DictMail:
    """The part of `mail.Mail` the log uses, over a dict; counts the records it is asked for."""

    def __init__(self) -> None:
        self.records: dict[str, msg.Message] = {}
        self.reads: list[tuple[str, int]] = []    # (kind, iteration) of every record read
        self.arrived: dict[type, int] = {}

    def send(self, message: msg.Message) -> None:
        self.records[message.key()] = message
        self.arrived[type(message)] = self.arrived.get(type(message), 0) + 1

    def arrivals(self, kind: type) -> int:
        return self.arrived.get(kind, 0)

    def get(self, kind: type, **ids: Any):
        self.reads.append((kind.__name__, ids.get("iteration", -1)))
        return self.records.get(kind.key_for(**ids))

    def get_many(self, kind: type, ids: list[Mapping[str, Any]]) -> list:
        return [self.get(kind, **i) for i in ids]

    def forget(self, iteration: int, keys: Sequence[str]) -> None:
        for key in keys:
            self.records.pop(key, None)


def loss(i: int) -> tuple[tuple[int, int, float], ...]:
    return tuple((p, m, i + 0.1 * p + 0.01 * m) for p in range(D) for m in range(M))


def mean(i: int) -> float:
    return sum(v for _, _, v in loss(i)) / (D * M)


def report(mail: DictMail, i: int, end: float, ranks=range(D * S), gen: int = 0) -> None:
    """Iteration i as its ranks report it: every rank's end (the latest `end`), the last
    stage's losses."""
    for rank in ranks:
        mail.send(msg.IterationDone(i, rank, gen, end - 0.01 * (D * S - 1 - rank)))
    for rank in LAST:
        mail.send(msg.Losses(i, rank, gen, loss(i)))


@pytest.fixture
def folder(tmp_path):
    f = claim(tmp_path / "run", False, False)
    yield f
    f.release()


def test_each_final_iteration_is_saved_with_its_end_and_a_late_end_is_saved_again(folder):
    """An iteration's row holds its loss and its end as far as its ranks reported it when the
    losses became final; when a rank's end comes later (its host's report was slower than the
    next iteration's losses), the row is written again at retirement with the moved end."""
    mail = DictMail()
    log = IterationLog(mail, folder, D, S, M, start=0, linger=1.0)
    report(mail, 0, 100.0)
    report(mail, 1, 101.0, ranks=range(3))   # rank 3's end of iteration 1 is late
    report(mail, 2, 102.0)
    log.save(now=0.0)
    assert log.next_loss == 2
    rows = read_rows(folder.run_dir)
    assert rows[0] == LossRow(0, mean(0), 0, 1, 100.0)
    assert rows[1].end == pytest.approx(101.0 - 0.01)   # rank 2's: the latest so far
    mail.send(msg.IterationDone(1, 3, 0, 101.0))
    log.retire(now=1.0)
    assert read_rows(folder.run_dir)[1] == LossRow(1, mean(1), 0, 1, 101.0)
    assert len((folder.run_dir / "losses.jsonl").read_text().splitlines()) == 3  # 0, 1, 1 again
    log.save(now=2.0, upto=3)
    assert log.ends_upto(3) == ([100.0, 101.0, 102.0], [0, 0, 0])
    assert read_losses(folder.run_dir) == {i: mean(i) for i in range(3)}


def test_a_later_attempt_reads_the_earlier_iterations_ends_back(folder):
    """A resumed run (or a coordinator taking over) starts its log at a later iteration: the
    ends of the iterations before come from losses.jsonl, so that its result has every
    iteration's end; their generation is another attempt's (-1). A worker's row written
    without an end (it lost its coordinator) keeps the end an earlier row gave."""
    mail = DictMail()
    first = IterationLog(mail, folder, D, S, M, start=0, linger=0.0)
    for i in range(4):
        report(mail, i, 100.0 + i)
    first.save(now=0.0)
    first.retire(now=0.0)
    assert first.next_loss == 3 and first.retired == 3
    append_losses(folder.run_dir, [{"iteration": 2, "loss": mean(2), "gen": None,
                                    "attempt": None}])  # a last-stage worker's, no end
    later = IterationLog(DictMail(), folder, D, S, M, start=3, linger=0.0)
    later.mail.records = {k: v for k, v in mail.records.items() if "/3/" in k}
    later.save(now=1.0, upto=4)
    assert later.ends_upto(4) == ([100.0, 101.0, 102.0, 103.0], [-1, -1, -1, 0])


def test_an_iteration_never_reported_has_no_end(folder):
    append_losses(folder.run_dir, [{"iteration": 0, "loss": 1.0, "gen": None,
                                    "attempt": None}])
    log = IterationLog(DictMail(), folder, D, S, M, start=2, linger=0.0)
    ends, gens = log.ends_upto(2)
    assert ends == [None, None] and gens == [-1, -1]
    assert math.isnan(log.ends[1])


def test_a_pass_waiting_for_the_next_iteration_reads_only_what_arrived(folder):
    """Iteration 0's losses all arrived; while iteration 1's have not, a pass reads nothing
    unless a `Losses` record arrived since the last (`Mail.arrivals`), and then only iteration
    1's ranks not read yet (what the first pass learned of 0 is kept); once 1's are there, 0 is
    read again to be saved (a redo's report could be newer) and saved once."""
    mail = DictMail()
    log = IterationLog(mail, folder, D, S, M, start=0, linger=1.0)
    report(mail, 0, 100.0)
    for now in range(3):
        log.save(now=float(now))
    losses_of = [i for kind, i in mail.reads if kind == "Losses"]
    assert losses_of.count(0) == 1 and losses_of.count(1) == len(LAST)
    assert log.next_loss == 0
    report(mail, 1, 101.0)
    mail.reads.clear()
    log.save(now=3.0)
    assert log.next_loss == 1 and read_losses(folder.run_dir) == {0: mean(0)}
    assert [i for kind, i in mail.reads if kind == "Losses"].count(0) == 1


def own(i: int, p: int, gen: int = 0, shift: float = 0.0) -> msg.Losses:
    """Iteration i's losses of pipeline p only, as its last-stage rank knows them."""
    return msg.Losses(i, LAST[p], gen, tuple((q, m, v + shift) for q, m, v in loss(i)
                                             if q == p))


def test_losses_split_over_ranks_are_read_once_each_and_a_redo_is_saved(folder):
    """Each last-stage rank reports only its own pipeline's losses: a pass after rank 1's
    arrived reads rank 3's (still missing) but not rank 1's again; the iteration counts as
    complete only once both arrived (a log that forgot what an earlier pass read would never
    see it complete; one that skipped a rank after it arrived would wait forever); a
    redo's report (a newer generation) that replaced a rank's first one is what is saved."""
    mail = DictMail()
    log = IterationLog(mail, folder, D, S, M, start=0, linger=1.0)
    mail.send(own(0, 0))                      # iteration 0: pipeline 0
    log.save(now=0.0)
    assert 0 not in log.complete
    mail.reads.clear()
    mail.send(own(0, 1))                      # then pipeline 1
    log.save(now=1.0)
    assert mail.reads == [("Losses", 0), ("Losses", 1), ("Losses", 1)]  # 0: rank 3 only
    assert 0 in log.complete and log.next_loss == 0
    mail.send(own(1, 1))                      # iteration 1: pipeline 1 first
    log.save(now=2.0)
    mail.reads.clear()
    log.save(now=2.5)                         # nothing arrived: nothing read
    assert mail.reads == []
    mail.send(own(0, 0, gen=1, shift=1.0))    # iteration 0 redone by generation 1
    mail.send(own(1, 0))                      # iteration 1: pipeline 0
    mail.reads.clear()
    log.save(now=3.0)
    # iteration 1's rank 1 (not rank 3 again), iteration 0's both (to save), then
    # iteration 2's both (nothing yet)
    assert [i for kind, i in mail.reads if kind == "Losses"] == [1, 0, 0, 2, 2]
    assert log.next_loss == 1 and 1 in log.complete
    redone = sum(v + (1.0 if p == 0 else 0.0) for p, _, v in loss(0)) / (D * M)
    assert read_losses(folder.run_dir) == {0: pytest.approx(redone)}
    assert read_rows(folder.run_dir)[0].gen == 1


def test_the_steps_a_fault_waits_for_are_retired_with_their_iteration(folder):
    """`stepped/{i}/{rank}` is written only where an injected fault of iteration i waits for
    rank's step (`faults.step_reports`): it leaves the mail with iteration i's records."""
    from recycle_planner.executor.control.mail import ON_STORE
    from recycle_planner.executor.control.relay import DIRECT
    from recycle_planner.executor.faults import parse_fault, step_reports

    assert set(ON_STORE) <= set(DIRECT)   # records on the store itself: deleted there
    faults = [parse_fault("3:1:optimizer:kill:after-step=1,2"),
              parse_fault("0:1:F0:kill:after-step=2")]
    assert step_reports(faults) == {1: (1, 2)}
    mail = DictMail()
    log = IterationLog(mail, folder, D, S, M, start=0, linger=0.0, stepped=step_reports(faults))
    for r in (1, 2):
        mail.send(msg.Stepped(1, r))
    for i in range(3):
        report(mail, i, 100.0 + i)
    log.save(now=0.0)
    log.retire(now=0.0)
    assert log.retired == 2
    assert not any(key.startswith("stepped/") for key in mail.records)


def test_a_row_appended_after_a_line_cut_short_by_a_crash_is_kept(tmp_path):
    """A coordinator killed while appending leaves half a line; the one that takes over
    appends the next iteration after it, and that row must not be glued onto it."""
    (tmp_path / "losses.jsonl").write_text('{"iteration":0,"loss":1.0}\n{"iteration":1,"lo')
    append_losses(tmp_path, [{"iteration": 1, "loss": 2.0}])
    rows = read_rows(tmp_path)
    assert sorted(rows) == [0, 1] and rows[1].loss == 2.0
