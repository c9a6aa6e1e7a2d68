"""The coordinator's view of workers on other hosts (`pool.HostPool`): exits and restarts
are taken from the relay's mail as they arrive (`Mail.take_new`), never looked up rank by rank
(looking up all 8,192 ranks' records twice a pass took a third of the coordinator's pass)."""

from pathlib import Path
from types import SimpleNamespace

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.mail import RelayMail
from recycle_planner.executor.control.pool import HostPool, Proc


class _Transport:
    """Nothing arrives but what a test hands the mail (`_take`); publishing goes nowhere."""

    def start(self, empty, nodes):
        pass

    def publish(self, version, bulletins):
        pass


class _Mail(RelayMail):
    """The relay's mail, counting its lookups."""

    looked = 0

    def get(self, kind, **ids):
        self.looked += 1
        return super().get(kind, **ids)


def _pool(nproc: int = 4):
    mail = _Mail(_Transport(), nnodes=2, per_host=2, beat_every=1.0)
    events = []
    agent = SimpleNamespace(mail=mail, procs={}, config=SimpleNamespace(nproc=nproc),
                            log_dir=Path("."), _name=str,
                            _event=lambda kind, text, **_: events.append(text))
    return HostPool(agent, 2), agent, mail, events


def _take(mail, message):  # as a host's report brings it
    mail._take(message)


def test_exits_are_taken_as_they_arrive_and_nothing_is_looked_up():
    pool, agent, mail, _ = _pool()
    agent.procs = {r: Proc(r, 0, None, Path("."), 0.0) for r in range(4)}
    assert pool.exits(agent.procs) == [] and mail.looked == 0
    _take(mail, msg.WorkerExit(2, 0, -9, "killed", ""))
    (ended,) = pool.exits(agent.procs)
    assert ended.proc.rank == 2 and ended.code == -9 and mail.looked == 0
    assert pool.exits(agent.procs) == []                        # handed once
    del agent.procs[2]
    _take(mail, msg.WorkerExit(1, 1, 0, "left", ""))            # before its process is known
    assert pool.exits(agent.procs) == []                        # (rank 1 runs incarnation 0)
    agent.procs[1] = Proc(1, 1, None, Path("."), 0.0)           # now it is: found, kept till then
    assert [e.proc.rank for e in pool.exits(agent.procs)] == [1]
    assert mail.looked == 0


def test_a_restart_is_found_once_its_host_reports_it():
    pool, agent, mail, events = _pool()
    agent.procs = {r: Proc(r, 0, None, Path("."), 0.0) for r in range(4)}
    # each pass looks for both hosts' HostUp, never for a rank's restart
    assert pool.started() == [] and mail.looked == 2
    _take(mail, msg.Spawned(2, 1))       # reported before incarnation 0's exit was reaped
    _take(mail, msg.Spawned(3, 0))       # the incarnation it runs: stale, dropped
    assert pool.started() == [] and mail.looked == 4
    del agent.procs[2]                   # its exit reaped: the restart is found, once
    (proc,) = pool.started()
    assert (proc.rank, proc.incarnation) == (2, 1) and "incarnation 1" in events[-1]
    assert pool.started() == [] and pool._spawned.held == {}


def test_a_restart_past_the_next_incarnation_is_found_and_an_older_one_dropped():
    """A host that died between counting a spawn on the store and reporting it comes back
    with the count past it: its worker's incarnation skips one. It is admitted all the same
    (wanting exactly the next one, the coordinator never would); of two restarts reported
    together, the newest is the process that runs."""
    pool, agent, mail, events = _pool()
    agent.procs = {r: Proc(r, 0, None, Path("."), 0.0) for r in range(4)}
    del agent.procs[1], agent.procs[3]
    _take(mail, msg.Spawned(1, 2))       # incarnation 1 counted, never reported
    _take(mail, msg.Spawned(3, 1))
    _take(mail, msg.Spawned(3, 2))       # 1 died at once, its host started 2
    started = {(p.rank, p.incarnation) for p in pool.started()}
    assert started == {(1, 2), (3, 2)}
    agent.procs.update({r: Proc(r, 2, None, Path("."), 0.0) for r in (1, 3)})
    assert pool.started() == [] and pool._spawned.held == {}   # (3, 1): stale, dropped
    del agent.procs[3]
    _take(mail, msg.Spawned(3, 1))       # a late report of the older one: never wanted
    assert pool.started() == [] and pool._spawned.held == {}
