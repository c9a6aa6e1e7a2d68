"""The coordinator's recovery path at scale (`agent.Agent` over `pool.HostPool`): what a pass
reads while it waits for the members' `Ready`s, and when a silent host is declared lost.
Each pass over every member's record cost milliseconds at 8,192 ranks
(`benchmarks/bench_relay.py --recovery`), so a pass looks again only once a record arrived;
these tests fail if that bookkeeping misses one."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch
pytest.importorskip("torch.distributed")

from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.agent import Agent, LaunchConfig, Phase  # noqa: E402
from recycle_planner.executor.control.pool import HostPool  # noqa: E402
from recycle_planner.executor.control.protocol import Decision  # noqa: E402
from recycle_planner.executor.control.runfolder import claim  # noqa: E402

PIPELINES, STAGES = 2, 2
RANKS = PIPELINES * STAGES


class _Spec:
    pipelines, stages, microbatches = PIPELINES, STAGES, 2


class _Hit:
    """What `Agent._decide` reads of a library hit."""

    def __init__(self, dead):
        self.file = Path(f"plan-{len(dead)}.json.gz")
        self.entry = self.metrics = self
        self.degradation, self.period = 0.0, 1.0


class _Lib:
    spec, reference_period = _Spec(), None

    def lookup(self, dead, plan=None):
        return _Hit(dead)

    def entry(self, counts):
        return None


@pytest.fixture
def agent(tmp_path):
    folder = claim(tmp_path / "run", False, False)
    config = LaunchConfig(nproc=RANKS, run_dir=str(tmp_path / "run"), checkpoint_every=0,
                          lease=1.0, heartbeat=0.2)
    agent = Agent(config, None, folder, HostPool, 2)   # 2 hosts of 2 ranks
    agent._start()
    agent.lib, agent.stages = _Lib(), STAGES
    agent.gen, agent.phase = 1, Phase.RUNNING
    agent.decision = Decision(gen=1, action="run", members=tuple(range(RANKS)), dead=(),
                              restart=0, incarnations={r: 0 for r in range(RANKS)})
    for proc in agent.procs.values():
        proc.hello = msg.Hello(proc.rank, 0, 0, "h", "lib", 0)
    reads = []
    get, present = agent.mail.get, agent.mail.present

    def counted(kind, **ids):
        reads.append(kind.__name__)
        return get(kind, **ids)

    def counted_present(kind, ids):
        reads.append(kind.__name__)
        return present(kind, ids)
    agent.mail.get, agent.mail.present = counted, counted_present
    agent.reads = reads
    try:
        yield agent
    finally:
        folder.release()


def test_a_started_coordinator_leaves_what_lives_as_long_as_it_out_of_the_collector(agent):
    """What the imports and the start made (torch's 250,000 objects, the coordinator itself)
    is out of the cyclic collector's full passes, each of which scanned it all: 0.25 s of a
    new leader's intake of the journals at 8,192 ranks (bench_relay.py --adoption)."""
    try:
        assert gc.get_freeze_count() > 100_000
        assert not any(o is agent or o is agent.mail for o in gc.get_objects())
        later = [agent]   # made after the start
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()   # this test process's collector as it was


def test_readys_are_read_once_each_and_the_last_one_brings_the_decision(agent):
    agent._abort("worker 1:1 lost")
    agent._phase_gathering(0.0)
    assert agent.reads.count("Ready") == RANKS        # the round's first look: every member
    agent.reads.clear()
    agent._phase_gathering(0.01)
    assert agent.reads == []                          # nothing arrived: nothing read
    for rank in range(RANKS - 1):
        agent.mail._take(msg.Ready(1, rank, 3, "failure"))
    agent.mail._take(msg.Ready(0, RANKS - 1, 9, "failure"))   # an older generation's
    agent._phase_gathering(0.02)
    assert agent.reads == []                          # taken as they came, none looked up
    assert agent.round.ready == {0: 3, 1: 3, 2: 3} and agent.gen == 1
    agent._phase_gathering(0.03)
    assert agent.gen == 1
    agent.mail._take(msg.Ready(1, RANKS - 1, 3, "failure"))   # the last one: decided
    agent._phase_gathering(0.04)
    assert agent.gen == 2 and agent.decision.members == tuple(range(RANKS))
    assert agent.decision.restart == 3 and agent.phase is Phase.RUNNING
    assert agent.mail.present(msg.Welcome, [{"rank": 0, "incarnation": 0}])


def test_restarted_workers_of_a_host_are_asked_to_join_together(agent):
    """Host 1 came back rebooted and started both its workers again: the first to say hello
    waits for the other, still starting, and they join at one boundary; a restart that says
    nothing within the start-up timeout holds the join back no longer."""
    from recycle_planner.executor.control.pool import Proc

    for rank in (2, 3):
        agent.procs[rank] = Proc(rank, 1, None, Path("."), 100.0)
    agent.procs[2].hello = msg.Hello(2, 1, 0, "h", "lib", None)
    agent._phase_running(103.0)
    assert not agent.round.join_posted and agent.phase is Phase.RUNNING
    agent.procs[3].hello = msg.Hello(3, 1, 0, "h", "lib", None)
    agent._phase_running(104.0)
    assert agent.round.join_posted and agent.phase is Phase.GATHERING
    assert "restarted workers 1:0, 1:1 asked to join" in agent.events[-1].message


def test_a_restart_silent_past_the_start_up_timeout_holds_no_join_back(agent):
    from recycle_planner.executor.control.pool import Proc

    for rank in (2, 3):
        agent.procs[rank] = Proc(rank, 1, None, Path("."), 100.0)
    agent.procs[2].hello = msg.Hello(2, 1, 0, "h", "lib", None)
    agent._phase_running(100.0 + agent.config.startup_timeout - 1)
    assert not agent.round.join_posted
    agent._phase_running(100.0 + agent.config.startup_timeout)
    assert agent.round.join_posted
    assert "restarted workers 1:0 asked to join" in agent.events[-1].message


def test_done_is_looked_for_again_only_once_one_arrives(agent):
    for rank in range(RANKS - 1):
        agent.mail._take(msg.Done(1, rank, 7))
    agent._phase_running(0.0)
    assert agent.phase is Phase.RUNNING and agent.reads == ["Done"]
    agent._phase_running(0.01)                        # nothing new: not looked at again
    assert agent.reads == ["Done"]
    agent.mail._take(msg.Done(1, RANKS - 1, 7))
    agent._phase_running(0.02)
    assert agent.phase is Phase.EXITING and agent.final_iterations == 7


def test_a_silent_host_is_declared_lost_as_its_lease_runs_out(agent):
    """Leases are checked every heartbeat (0.2 s) and also when the oldest one runs out:
    host 1, silent since 0, is declared lost at 1.0 s plus a poll, not at the next
    heartbeat's check (1.2 s); host 0, which kept reporting, is not."""
    mail = agent.mail
    for proc in agent.procs.values():
        proc.last_beat = 0.0
    for step in range(5):                             # host 0 reports, host 1 is silent
        now = 0.2 * step + 0.05
        mail.host_seq[0] = step
        agent._heartbeats(now)
    assert not agent.deaths
    assert agent.next_beat_check == pytest.approx(1.0 + agent.config.poll)
    agent._heartbeats(1.0 + agent.config.poll)
    assert sorted(d.rank for d in agent.deaths) == [2, 3]
    assert agent.phase is Phase.GATHERING             # the abort went out


def test_a_new_leader_adopts_a_generation_whose_workers_all_died_meanwhile(agent):
    """Every host re-attached, none with a live worker (they died while the coordinators
    changed): there is no `Hello` to wait for, so the new leader adopts at once and counts
    the members as deaths of the generation, instead of waiting for a `Hello` forever."""
    import time

    decision = agent.decision
    agent.phase, agent.gen, agent.decision = Phase.ADOPTING, -1, None
    agent.t0 = agent.awaited_said = time.time()
    for node in (0, 1):
        agent.mail._take(msg.Attach(node, decision.gen, decision.to_json(), ()))
    agent._phase_adopting(time.time())
    assert agent.phase is Phase.GATHERING              # abandoned: the ordinary recovery
    deaths = [e for e in agent.events if e.kind.value == "death"]
    assert len(deaths) == RANKS and "while the coordinators changed" in deaths[0].message
