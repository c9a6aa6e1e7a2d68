"""The pure parts of a live takeover: what a host agent keeps and re-sends to a coordinator
that takes over (`relay.Journal`), and what that coordinator adopts (`takeover.Adoption`)."""

from dataclasses import replace

from recycle_planner.executor.control import messages as msg
from recycle_planner.executor.control.mail import RelayMail
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.control.relay import HostReport, Journal, keeps
from recycle_planner.executor.control.takeover import Adoption, Waiting
from helpers.waiting import wait_for


class _Transport:
    """Just what RelayMail calls here: the reports that arrived, and bulletins published."""

    def __init__(self):
        self.queue, self.published = [], []

    def take(self):
        taken, self.queue = self.queue, []
        return taken

    def start(self, empty, nodes):
        self.published.append(0)

    def publish(self, version, bulletins):
        self.published.append(version)


def _journal_of(*messages):
    journal = Journal()
    for m in messages:
        journal.add(m)
    return journal


def test_the_journal_re_sends_each_record_once_by_its_rule():
    journal = _journal_of(
        msg.Hello(0, 0, 10, "h", "lib", 0), msg.CommError(1, 0), msg.CommError(1, 1),
        msg.Bug(1, 0, 3, "first"), msg.Bug(1, 1, 3, "second"),
        msg.OpTimes(0, {"0": {"F": [1, 1.0, 1.0]}}), msg.OpTimes(0, {"1": {"F": [2, 2.0, 2.0]}}))
    kinds = [kind for kind, _ in journal.records()]
    assert kinds == ["Hello", "CommError", "CommError", "Bug", "OpTimes"]
    texts = dict(journal.records())
    assert msg.Bug.from_json(texts["Bug"]).traceback == "first"       # first wins
    assert '"1"' in texts["OpTimes"]                                   # the latest set wins


def test_the_journal_keeps_one_end_per_iteration_for_the_host():
    """A new leader reads of an iteration's ends only their latest time and generation: the
    journal keeps one record per iteration, not one per rank, and the leader finds the same
    ends as from every rank's."""
    ends = [msg.IterationDone(3, 0, 1, 10.0), msg.IterationDone(3, 1, 1, 10.5),
            msg.IterationDone(3, 2, 1, 10.2), msg.IterationDone(4, 0, 1, 11.0),
            msg.IterationDone(4, 1, 2, 10.9),   # a later generation, an earlier time
            msg.IterationDone(5, 0, 2, 12.0)]
    journal = _journal_of(*ends)
    texts = [text for kind, text in journal.records() if kind == "IterationDone"]
    assert len(texts) == 3
    assert texts[0] == ends[1].to_json()               # the latest end, as its worker sent it
    kept = [msg.IterationDone.from_json(t) for t in texts]
    assert [(d.iteration, d.gen, d.t) for d in kept] == [(3, 1, 10.5), (4, 2, 11.0),
                                                         (5, 2, 12.0)]
    transport = _Transport()
    mail = RelayMail(transport, nnodes=1, per_host=3, beat_every=1.0)
    transport.queue.append(HostReport(0, 1, tuple(journal.records())).to_json())
    mail.refresh()
    for i in (3, 4, 5):   # what `IterationLog._end` takes of them
        found = [d for d in mail.get_many(msg.IterationDone, [{"iteration": i, "rank": r}
                                                              for r in range(3)]) if d]
        sent = [d for d in ends if d.iteration == i]
        assert (max(d.t for d in found), max(d.gen for d in found)) == \
            (max(d.t for d in sent), max(d.gen for d in sent))


def test_a_count_re_sent_to_a_new_coordinator_counts_once():
    """What was batched but not sent, and what was sent, are both in the journal: the new
    coordinator's counts start from nothing, so each error counts once."""
    journal = _journal_of(msg.CommError(2, 0), msg.CommError(2, 1))
    transport = _Transport()
    mail = RelayMail(transport, nnodes=1, per_host=2, beat_every=1.0)
    transport.queue.append(HostReport(0, 7, tuple(journal.records())).to_json())
    mail.refresh()
    assert mail.count(msg.CommError, gen=2) == 2


def test_the_journal_keeps_what_is_not_durable_yet():
    progress = msg.Progress(losses=5, checkpoint=4)
    assert not keeps(msg.Losses(4, 1, 0, ()), progress, 0)
    assert keeps(msg.Losses(5, 1, 0, ()), progress, 0)
    assert not keeps(msg.IterationDone(4, 1, 0, 0.0), progress, 0)
    assert not keeps(msg.CheckpointWritten(4, 0), progress, 0)
    assert keeps(msg.CheckpointWritten(8, 0), progress, 0)
    assert keeps(msg.Losses(0, 1, 0, ()), None, 0)           # nothing made durable yet
    assert not keeps(msg.Ready(1, 0, 3, "failure"), progress, 3)  # generations long past
    assert keeps(msg.Ready(2, 0, 3, "failure"), progress, 3)
    assert keeps(msg.Hello(0, 0, 10, "h", "lib", 0), progress, 9)
    assert keeps(msg.WorkerExit(0, 0, 1, "died", ""), progress, 9)
    journal = _journal_of(msg.Losses(4, 1, 0, ()), msg.Losses(6, 1, 0, ()),
                          msg.HostUp(0, "h", 1, (0, 1)))
    journal.prune(progress, 0)
    assert [kind for kind, _ in journal.records()] == ["Losses", "HostUp"]


def _decision(gen: int, incarnations=None) -> Decision:
    return Decision(gen, "run", (0, 1, 2, 3), (), 3, plan="k0.json.gz",
                    incarnations=incarnations or {r: 0 for r in range(4)})


def test_the_newest_decision_any_host_holds_is_adopted_with_what_was_said_of_it():
    attaches = [
        msg.Attach(0, 1, _decision(1).to_json(), ((0, 0), (1, 0)), saved=2),
        msg.Attach(1, 2, _decision(2).to_json(), ((2, 0), (3, 0)), abort="worker 1:0 died",
                   saved=3)]
    adoption = Adoption.of(attaches)
    assert adoption.decision.gen == 2 and adoption.abort == "worker 1:0 died"
    assert not adoption.join and adoption.saved == 3
    assert dict(adoption.workers) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert adoption.lost_members() == []


def test_a_switch_agreed_on_the_lost_store_abandons_the_adopted_generation():
    """Members that heard where to leave the generation (on the lost store) cannot have it
    agreed again on the new one: the adopting coordinator abandons it; a join asked but not
    yet agreed is asked again; the lost coordinator's own abort comes first."""
    asked = [msg.Attach(0, 2, _decision(2).to_json(), ((0, 0), (1, 0)), join=True),
             msg.Attach(1, 2, _decision(2).to_json(), ((2, 0), (3, 0)), join=True)]
    assert Adoption.of(asked).join and Adoption.of(asked).abort_reason() is None
    heard = [asked[0], replace(asked[1], switch_at=9),
             msg.Attach(2, 1, _decision(1).to_json(), (), switch_at=4)]  # an older one's
    adoption = Adoption.of(heard)
    assert adoption.switch_at == 9 and "iteration 9" in adoption.abort_reason()
    aborted = Adoption.of([replace(heard[1], abort="worker 1:0 died")])
    assert aborted.abort_reason() == "worker 1:0 died"


def test_members_no_host_runs_are_lost_and_nothing_held_is_nothing_to_adopt():
    attaches = [msg.Attach(0, 4, _decision(4, {0: 1, 1: 0, 2: 0, 3: 0}).to_json(),
                           ((0, 0), (1, 0)))]  # host 1 did not re-attach; rank 0 is stale
    assert Adoption.of(attaches).lost_members() == [0, 2, 3]
    assert Adoption.of([msg.Attach(0, -1, "", ((0, 0),))]) is None
    assert Adoption.of([]) is None


def test_the_new_coordinator_saves_losses_from_the_first_the_lost_one_had_not_saved():
    """The lost coordinator (attempt 2) saved iterations 5 and 6 after telling the hosts
    mark 5: the new one starts at 7, not 5 (which would write 5 and 6 twice); rows of
    another attempt (a stopped worker's, an earlier run's) do not count."""
    from recycle_planner.executor.control.runfolder import LossRow

    adoption = Adoption.of([msg.Attach(0, 1, _decision(1).to_json(), ((0, 0),), saved=5)])
    rows = {i: LossRow(i, 0.5, 1, 2) for i in range(7)}
    assert adoption.saving_from(rows, lost=[2]) == 7
    assert adoption.saving_from({**rows, 6: LossRow(6, 0.5, None, None)}, [2]) == 6
    assert adoption.saving_from({i: LossRow(i, 0.5, 1, 1) for i in range(9)}, [2]) == 5
    unmarked = replace(adoption, saved=-1)   # no host was told: from the restart (3)
    assert unmarked.saving_from({}, [2]) == 3 and unmarked.saving_from(rows, [2]) == 7


def test_after_two_takeovers_the_rows_of_both_lost_coordinators_are_skipped():
    """Attempt 1 saved 5 and 6 after marking 5, attempt 2 took over from 7, saved 7 and was
    lost before telling a mark: attempt 3 (hosts still at mark 5) starts at 8. Before, it
    skipped attempt 2's rows only, stopped at 5 and wrote 5, 6 and 7 twice."""
    from recycle_planner.executor.control.runfolder import LossRow

    adoption = Adoption.of([msg.Attach(0, 1, _decision(1).to_json(), ((0, 0),), saved=5)])
    rows = {**{i: LossRow(i, 0.5, 1, 1) for i in range(7)}, 7: LossRow(7, 0.5, 1, 2)}
    assert adoption.saving_from(rows, lost=range(1, 3)) == 8


def test_a_run_folder_records_which_attempts_took_over_from_which(tmp_path):
    from recycle_planner.executor.control.runfolder import claim

    run = tmp_path / "run"
    chain = []
    for take_over in (False, True, True):
        folder = claim(run, False, False, take_over=take_over)
        chain.append((folder.record.attempt, list(folder.record.taken_over())))
        folder.release()
    (run / "checkpoints" / "iter-000004").mkdir(parents=True)  # a checkpoint to resume
    (run / "checkpoints" / "iter-000004" / "manifest.json").write_text("{}")
    (run / "checkpoints" / "latest.json").write_text(
        '{"folder": "iter-000004", "iteration": 4}')
    resumed = claim(run, True, False)
    assert chain == [(1, []), (2, [1]), (3, [1, 2])]
    assert list(resumed.record.taken_over()) == []  # a resume starts its own
    resumed.release()


def test_a_coordinator_taking_over_waits_for_the_hosts_etcd_holds_only():
    def wait(answered, held, waited):
        return Waiting.of(range(4), answered, held, waited, lease=4.0, bound=300.0)

    assert wait([0, 2], {0, 1, 2}, 1.0).awaited == (1,)  # host 3's lease is gone: lost
    assert wait([0, 2], {0, 1, 2}, 1.0).gone == (3,)
    assert wait([0, 2], {0, 1, 2, 3}, 1.0).awaited == (1, 3)
    done = wait([0, 1, 2, 3], {0}, 1.0)
    assert done.awaited == done.gone == done.late == () and done.said() == ""
    # etcd cannot say, or no host holds a lease there (no node ranks): wait for every one
    assert wait([0, 2], None, 1.0).awaited == (1, 3)
    assert wait([0, 2], set(), 1.0).awaited == (1, 3)


def test_a_live_host_that_re_attaches_slowly_is_waited_for_up_to_the_rendezvous_timeout():
    """A host whose lease etcd holds is alive: three leases (and far more) after the new
    leader started it is still waited for, not declared dead with its workers (at 128
    ranks, a leader that gave up after three leases declared 88 live workers dead); only
    past the rendezvous timeout, when its own agent gives up too, is it lost. Without
    etcd's word, a host absent for three leases is lost."""
    def wait(held, waited):
        return Waiting.of(range(4), [0], held, waited, lease=4.0, bound=300.0)

    slow = wait({0, 1, 2}, 3 * 4.0 + 0.1)
    assert slow.awaited == (1, 2) and slow.gone == (3,) and slow.late == ()
    assert wait({0, 1, 2}, 299.0).awaited == (1, 2)
    late = wait({0, 1, 2}, 300.0)
    assert late.awaited == () and late.gone == (3,) and late.late == (1, 2)
    assert "[3] hold no lease" in late.said() and "[1, 2] did not re-attach within 300 s" \
        in late.said()
    unknown = wait(None, 3 * 4.0)
    assert unknown.awaited == () and unknown.late == (1, 2, 3) and unknown.limit == 12.0


def test_a_new_store_counts_each_ranks_incarnations_on_from_the_runs():
    """A store started by a coordinator that took over counts from zero: the host agents that
    re-attached (when they first restart a worker there) and the new coordinator (for ranks
    no host runs) raise each rank's count to the run's, whoever comes first, and it is never
    lowered; a rebooted host's workers then spawn as the next incarnation, not as the one
    that was killed."""
    from datetime import timedelta

    import pytest
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    msg.count_incarnations_from(store, 0, 3)  # the coordinator: the decision had incarnation 2
    msg.count_incarnations_from(store, 0, 2)  # a host agent that counts less: not lowered
    assert msg.next_incarnation(store, 0) == 3
    msg.count_incarnations_from(store, 1, 1)
    msg.count_incarnations_from(store, 1, 4)  # its worker restarted meanwhile: raised
    assert [msg.next_incarnation(store, 1) for _ in range(2)] == [4, 5]
    assert msg.next_incarnation(store, 2) == 0  # nobody said anything: from the start


def test_a_host_agent_dials_a_store_that_listens_only_after_the_lease():
    """The next leader's store may listen only after its publication (and a connection's
    first packet can be lost): connecting waits for it; the calls then time out within the
    lease."""
    import threading
    import time
    from datetime import timedelta

    import pytest
    import torch.distributed as dist

    from recycle_planner.executor.control.etcd_local import free_ports
    from recycle_planner.executor.control.hostagent import dial

    port, lease = free_ports(1)[0], 0.3
    servers = []
    later = threading.Timer(2 * lease, lambda: servers.append(dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))))
    later.start()
    try:
        store = dial("127.0.0.1", port, 10.0, lease)
        store.set("k", "v")
        assert store.get("k") == b"v"
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            store.get("absent")
        assert time.monotonic() - t0 < 10 * lease
    finally:
        later.join()


def test_a_host_agent_looks_again_past_a_successor_whose_store_does_not_answer():
    """A host ranked by arrival dials the successor's store at once (to raise the count of
    hosts there). A successor that died after publishing leaves its key for a lease: the host
    agent dials it, gets no answer within two leases, and looks again, finding the next one;
    with none answering it gives up within `rdzv_timeout` (its thread), or a lease after it
    (its loop, should a call hang)."""
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from recycle_planner.executor.control.etcd_local import free_ports
    from recycle_planner.executor.control.hostagent import HostAgent

    live = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    published = [(dead, 7), (f"127.0.0.1:{live.port}", 9)]
    agent = SimpleNamespace(lease=0.25, node_rank=0, on_event=lambda line: None,
                            config=SimpleNamespace(rdzv_timeout=5.0, startup_timeout=10.0,
                                                   node_rank=None),
                            successor=SimpleNamespace(find=lambda timeout: published.pop(0)))
    agent._dial = lambda endpoint: HostAgent._dial(agent, endpoint)
    finding = {"since": time.monotonic()}
    HostAgent._find_successor(agent, finding)
    endpoint, revision, store = finding["found"]  # one connection: the relay stays on etcd
    assert (endpoint, revision) == (f"127.0.0.1:{live.port}", 9)
    assert isinstance(store, dist.TCPStore) and store.add("probe", 1) == 1

    agent.successor = SimpleNamespace(find=lambda timeout: (dead, 7))
    agent.config.rdzv_timeout = 1.0
    finding = {"since": time.monotonic()}
    HostAgent._find_successor(agent, finding)
    assert "failed" in finding and time.monotonic() - finding["since"] < 5.0
    agent.finding = {"since": time.monotonic() - 2.0}  # a thread still inside a call
    assert "no coordinator took over" in HostAgent._reattach_due(agent)
    agent.finding = {"since": time.monotonic()}
    assert HostAgent._reattach_due(agent) is None


def test_a_host_agent_with_its_node_rank_finds_the_next_leader_without_dialling_it():
    """Its relay's traffic is on etcd: a host that knows its node rank needs nothing of the
    next leader's store (which may not listen yet) until it restarts a worker, so the
    successor is found as soon as it is published; before, every host dialled it at once,
    each connection in turn on the store's one accepting thread."""
    import time
    from types import SimpleNamespace

    from recycle_planner.executor.control.etcd_local import free_ports
    from recycle_planner.executor.control.hostagent import HostAgent

    silent = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    agent = SimpleNamespace(lease=5.0, node_rank=0, on_event=lambda line: None,
                            config=SimpleNamespace(rdzv_timeout=30.0, startup_timeout=30.0,
                                                   node_rank=0),
                            successor=SimpleNamespace(find=lambda timeout: (silent, 7)))
    finding = {"since": time.monotonic()}
    HostAgent._find_successor(agent, finding)
    assert finding["found"] == (silent, 7, None)
    assert time.monotonic() - finding["since"] < 5.0


def test_a_re_attached_host_raises_a_ranks_count_on_the_new_store_when_it_restarts_it():
    """Re-attaching makes no call on the new leader's store (still starting, its one thread
    accepting every host at once); the first restart of a rank there dials it (once) and
    raises the rank's count past the incarnation the host runs, so the restarted worker is
    the next incarnation, not 0 again."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from recycle_planner.executor.control.hostagent import HostAgent
    from recycle_planner.executor.control.store import MemoryStore
    from recycle_planner.executor.control.transport import EtcdHost

    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=10))
    agent = SimpleNamespace(lease=2.0, config=SimpleNamespace(startup_timeout=10.0))
    agent._dial = lambda endpoint: HostAgent._dial(agent, endpoint)
    dialled = []
    groups = HostAgent._groups(agent, f"127.0.0.1:{new.port}", None)

    def counting():
        dialled.append(groups())
        return dialled[-1]
    host = EtcdHost(MemoryStore(), "/recycle/job/relay/", 0, counting, to=9,
                    counted={0: 3, 1: 0})
    assert dialled == [] and new.num_keys() == 0  # nothing on the new store yet
    assert [host.next_incarnation(0) for _ in range(2)] == [4, 5]
    assert host.next_incarnation(1) == 1
    assert host.next_incarnation(2) == 0                 # a rank it never ran
    assert len(dialled) == 4 and len({id(s) for s in dialled}) == 1   # dialled once


def test_a_host_agent_whose_re_attach_fails_on_the_new_store_looks_again():
    """A connection reset while a host ranked by arrival raises the count of hosts on the
    next leader's store (a store swamped by a takeover's connections) is no reason to stop
    the workers: the host agent looks for the leader again, within the same `rdzv_timeout`
    from the loss."""
    import threading
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from recycle_planner.executor.control.hostagent import HostAgent

    class _Reset:
        def compare_set(self, key, expected, desired):
            raise dist.DistError("Connection reset by peer")

    looked, said = threading.Event(), []

    def find(timeout):
        looked.set()
        raise RuntimeError("stopped here")

    successor = SimpleNamespace(revision=7, find=find,
                                relay=lambda node, groups, counted: None)
    successor.after = lambda revision: successor
    agent = SimpleNamespace(
        lease=0.25, node_rank=3, on_event=said.append, incarnations={192: 0, 193: 1},
        config=SimpleNamespace(rdzv_timeout=5.0, startup_timeout=10.0, node_rank=None,
                               rdzv_id="job"),
        successor=successor, relay=SimpleNamespace(decisions={0: ""}))
    agent._groups = lambda endpoint, store: HostAgent._groups(agent, endpoint, store)
    agent._look = lambda since, pause=0.0: HostAgent._look(agent, since, pause)
    agent._find_successor = lambda finding, pause: HostAgent._find_successor(agent, finding,
                                                                             pause)
    since = time.monotonic() - 1.0
    agent.finding = {"since": since, "found": ("127.0.0.1:1", 9, _Reset())}
    assert HostAgent._reattach_due(agent) is None          # not lost: looking again
    assert not looked.wait(0.03)                           # after a quarter lease, not at once
    assert agent.finding["since"] == since and looked.wait(5.0)
    assert "Connection reset by peer" in said[-1] and said[-1].endswith("looking again")
    # past the rdzv timeout from the loss, a failing store is no reason to look on forever
    agent.finding = {"since": time.monotonic() - 6.0,
                     "found": ("127.0.0.1:1", 9, _Reset())}
    assert HostAgent._reattach_due(agent) == "no coordinator took over within 5 s"


def test_a_counter_raised_again_counts_nothing_twice():
    """A host ranked by arrival, re-attaching, raises the arrival counter on the new store
    to what it holds (and later its workers' incarnation counts, `test_a_re_attached_host_...`); a retry after a lost answer changes nothing, an add
    counts on from there, and a counter is never lowered."""
    import datetime

    import torch.distributed as dist

    from recycle_planner.executor.control.messages import raise_counter

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    raise_counter(store, "nodes", 4)
    raise_counter(store, "nodes", 4)                       # the same host again
    raise_counter(store, "nodes", 2)                       # a lower rank: not lowered
    assert store.add("nodes", 1) == 5


def test_a_standby_makes_its_etcd_client_before_it_leads(monkeypatch):
    """Importing the etcd client and connecting took 0.9 s of a takeover at 1,024 ranks on
    2 loaded cores, after the word to lead: a standby does it while it stands by, and the
    coordinator it becomes uses that client (etcd not answering then changes nothing)."""
    import io
    import os
    import sys
    import threading

    from recycle_planner.executor.control import failover
    from recycle_planner.executor.control.etcd_local import free_ports

    endpoints = f"127.0.0.1:{free_ports(1)[0]}"  # nothing answers there
    failover._leases_store.cache_clear()
    read, write = os.pipe()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(os.fdopen(read, "rb")))
    monkeypatch.setenv(failover.STANDBY_ENV, "1")
    monkeypatch.setenv(failover.HOSTS_ENV, failover.HostLeases(endpoints, "job", 0.5).to_json())
    words = []
    standby = threading.Thread(target=lambda: words.append(failover.standby_word()))
    standby.start()
    try:
        assert wait_for(lambda: failover._leases_store.cache_info().currsize == 1, 20)
        made = failover._leases_store(endpoints, 0.5)
    finally:
        os.write(write, b"take-over 12\n")
        os.close(write)
        standby.join(20)
    assert words == [failover.TAKE_OVER]
    leases = failover.HostLeases.from_env()
    assert leases.publication == 12 and leases._store is made
    failover._leases_store.cache_clear()
