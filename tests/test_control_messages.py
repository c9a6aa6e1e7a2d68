"""The typed messages between the processes of a job: every record survives its JSON, is
bound to one key, and keeps its key's rule on a real c10d store."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest

from recycle_planner.executor.control import messages as msg

RECORDS = [cls for _, cls in inspect.getmembers(msg, inspect.isclass)
           if issubclass(cls, msg.Message) and cls is not msg.Message]

SAMPLES = {
    "Hello": msg.Hello(3, 1, 4242, "h0", "/lib", None),
    "Heartbeat": msg.Heartbeat(3, 1, 12.5),
    "Ready": msg.Ready(2, 3, 7, "failure"),
    "Done": msg.Done(2, 3, 8),
    "Stopped": msg.Stopped(2, 3),
    "Bug": msg.Bug(2, 3, 5, "Traceback ...\nValueError: x"),
    "CommError": msg.CommError(2, 3),
    "SwitchAt": msg.SwitchAt(2, 9),
    "IterationDone": msg.IterationDone(4, 3, 2, 99.0),
    "Losses": msg.Losses(4, 3, 2, ((0, 0, 1.5), (1, 3, 0.25))),
    "CheckpointWritten": msg.CheckpointWritten(4, 1),
    "OpTimes": msg.OpTimes(3, {"0": {"F": [4, 0.1, 0.09]}}),
    "FaultFired": msg.FaultFired(3, 0, 12.0, "3:2:F1:kill"),
    "Stepped": msg.Stepped(4, 3),
    "Shape": msg.Shape(0, '{"leaves": []}'),
    "Welcome": msg.Welcome(3, 1, -1),
    "Abort": msg.Abort(2, "worker 1:0 killed"),
    "JoinRequest": msg.JoinRequest(2),
    "Finish": msg.Finish(2),
    "HostUp": msg.HostUp(1, "h1", 77, (2, 3)),
    "WorkerExit": msg.WorkerExit(3, 0, -9, "killed by SIGKILL", "last"),
    "Kill": msg.Kill(3, 0),
    "Spawned": msg.Spawned(3, 1),
    "Bye": msg.Bye(1),
    "Outcome": msg.Outcome("completed", "trained 8 iterations"),
    "Attach": msg.Attach(1, 2, '{"gen":2}', ((2, 0), (3, 1)), "worker 1:0 died", True, 6),
    "Progress": msg.Progress(7, 4),
}


def test_every_record_has_a_sample_a_key_over_its_fields_and_survives_json():
    assert sorted(c.__name__ for c in RECORDS) == sorted(SAMPLES)
    keys = set()
    for record in SAMPLES.values():
        fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
        assert record.key() == type(record).key_for(**fields)
        assert type(record).from_json(record.to_json()) == record
        keys.add(type(record).KEY)
    assert len(keys) == len(SAMPLES)  # one key pattern per record type


def test_a_records_json_is_its_fields_as_dataclasses_writes_them():
    """The encoding reads the fields without `dataclasses.asdict`'s deep copy: the text is
    the same, so the records on the wire did not change."""
    import json

    for record in [*SAMPLES.values(), msg.Ready(2, 3, None, "switch", 4, ((4, (0.5, 2.0)),))]:
        assert record.to_json() == json.dumps(dataclasses.asdict(record),
                                              separators=(",", ":"))


def test_a_record_missing_a_field_is_refused():
    with pytest.raises(TypeError):
        msg.Ready.from_json('{"gen": 1, "rank": 2}')


def test_key_rules_on_a_real_store():
    torch = pytest.importorskip("torch")
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=10))
    assert msg.get(store, msg.Ready, gen=1, rank=0) is None
    msg.put(store, msg.Ready(1, 0, 5, "failure"))
    msg.put(store, msg.Ready(1, 0, 6, "switch"))  # `set`: the latest replaces
    assert msg.get(store, msg.Ready, gen=1, rank=0) == msg.Ready(1, 0, 6, "switch")
    first = msg.put(store, msg.SwitchAt(1, 9))
    again = msg.put(store, msg.SwitchAt(1, 12))  # `first`: every proposer learns the winner
    assert first == again == msg.SwitchAt(1, 9)
    assert msg.count(store, msg.CommError, gen=1) == 0
    assert [msg.put(store, msg.CommError(1, r)) for r in (0, 3)] == [1, 2]
    assert msg.count(store, msg.CommError, gen=1) == 2
    assert not msg.present(store, msg.Done, [{"gen": 1, "rank": r} for r in (0, 1)])
    for r in (0, 1):
        msg.put(store, msg.Done(1, r, 8))
    assert msg.present(store, msg.Done, [{"gen": 1, "rank": r} for r in (0, 1)])


def test_a_decision_names_the_incarnations_it_counts_on_and_excludes_the_rest():
    """Fencing: a worker process that reads a decision which does not count on it (its rank is
    not a member, or a newer incarnation took its place) leaves without acting on it."""
    from recycle_planner.executor.control import protocol as P

    decision = P.decide(3, 2, 2, {0: 5, 1: 5, 2: None}, lambda dead: ("k0-1.json.gz", 0.1),
                        incarnations={0: 0, 1: 0, 2: 1})
    back = P.Decision.from_json(decision.to_json())
    assert back == decision and back.incarnations == {0: 0, 1: 0, 2: 1}
    assert not back.excludes(2, 1)
    assert back.excludes(2, 0)          # the stale process of a restarted rank
    assert back.excludes(3, 0)          # a rank declared dead
    anyone = P.Decision.from_json(P.Decision(1, "run", (0,), (), 0).to_json())
    assert anyone.incarnations == {}
    assert not anyone.excludes(0, 7)    # a decision that names none counts on any


def _random_decision(rng, ranks: int):
    """A decision with holes in its members (dead hosts and single ranks), incarnations for
    all, some or none of them (mostly 0, a few restarts), and sources for some."""
    from recycle_planner.executor.control import protocol as P

    members = tuple(r for r in range(ranks) if rng.random() > rng.choice((0.0, 0.05, 0.5)))
    named = [r for r in members if rng.random() < rng.choice((0.0, 0.7, 1.0))]
    incarnations = {r: rng.choice((0, 0, 0, 1, 2, 7)) for r in named}
    sources = {r: rng.choice((r % 4, 0, 1)) for r in members if rng.random() < 0.3}
    return P.Decision(rng.randrange(9), rng.choice(("run", "stop")), members,
                      tuple((r // 4, r % 4) for r in range(ranks) if r not in members),
                      rng.randrange(5), sources, rng.choice((None, "k.json.gz")),
                      rng.choice((None, 0.25)), rng.choice(("", "why")), incarnations,
                      rng.choice(({}, {3: (1.5, float("inf"))})))


def test_a_decision_survives_its_compact_wire_format_and_fences_the_same_processes():
    """Members as runs, incarnations and sources as arithmetic runs: every decision comes
    back equal, and excludes exactly the worker processes it excluded (holes, restarted
    ranks, ranks it names no incarnation for, an empty one)."""
    import random

    from recycle_planner.executor.control import protocol as P

    rng = random.Random(22)
    cases = [_random_decision(rng, rng.choice((1, 5, 40, 300))) for _ in range(200)]
    cases.append(P.Decision(4, "stop", (), ((0, 0), (0, 1)), 0, reason="no live worker"))
    for decision in cases:
        back = P.Decision.from_json(decision.to_json())
        assert back == decision
        ranks = range(max(decision.members, default=0) + 2)
        assert [back.excludes(r, i) for r in ranks for i in range(8)] == \
            [decision.excludes(r, i) for r in ranks for i in range(8)]


def test_a_host_lost_at_8192_ranks_is_a_decision_of_under_a_kilobyte():
    """The decision every survivor decodes after a host's loss names 8,128 members and their
    incarnations: a run each, not 112 kB of ranks spelled out."""
    from recycle_planner.executor.control import protocol as P

    lost = set(range(8128, 8192))
    decision = P.decide(2, 1024, 8, {r: 7 for r in range(8192) if r not in lost},
                        lambda dead: ("k.json.gz", 0.1), incarnations=dict.fromkeys(
                            range(8192), 0))
    text = decision.to_json()
    assert len(text) < 1000 and P.Decision.from_json(text) == decision
    assert not decision.excludes(0, 0) and decision.excludes(8128, 0)


def test_a_decision_of_another_format_version_is_refused_in_one_line():
    from recycle_planner.errors import RecycleError
    from recycle_planner.executor.control import protocol as P

    unnumbered = ('{"gen": 1, "action": "run", "members": [0], "dead": [], "restart": 0, '
                  '"sources": {}}')
    for text in (unnumbered, '{"v": 3, "gen": 1}', "[]"):
        with pytest.raises(RecycleError, match="format version") as caught:
            P.Decision.from_json(text)
        assert "\n" not in str(caught.value)
    with pytest.raises(RecycleError, match="format version 1, "):  # before versions, 1
        P.Decision.from_json(unnumbered)


def test_only_an_error_with_a_frame_of_user_code_is_a_users_bug(tmp_path):
    """An exception raised by the executor's own code (every frame in the package or the
    standard library, say a `list.index` in comm.py) fails that worker; one raised while
    user code runs (the job's file, or torch called from it) stops the job as a bug."""
    pytest.importorskip("torch")
    import importlib.util

    from recycle_planner.executor.worker import raised_in_user_code
    from recycle_planner.job.workers import format_workers

    user = tmp_path / "user_job.py"
    user.write_text("def forward(x):\n    raise ValueError('bad shape')\n")
    spec = importlib.util.spec_from_file_location("user_job", user)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def caught(exc: BaseException) -> BaseException:
        return exc.with_traceback(exc.__traceback__.tb_next)  # as the worker catches it

    try:
        format_workers(5)  # the package's own code fails (a TypeError inside it)
    except TypeError as exc:
        assert not raised_in_user_code(caught(exc))
    try:
        module.forward(1)
    except ValueError as exc:
        assert raised_in_user_code(caught(exc))
