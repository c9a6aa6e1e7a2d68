"""NCCL's rules, one by one: for each, a hand-made order that breaks it, which the replay
(`programs/nccl.py`) must catch under the model that has the rule and pass under the model
before it (so that the test shows the rule is what catches it). The fast check that every
plan passes (`programs/check.py`, the `serial` model by events) gives the same verdict as the
item-by-item replay on every one of them."""

from dataclasses import replace

from recycle_planner.programs import (AllReduce, Compute, Optimizer, Program, Orders, Recv,
                                      Send, check_orders, replay)

ACT, GRAD = "activation", "gradient"


def message(kind, what, mb, peer):
    """Message `what` of micro-batch `mb` of pipeline 0; its tag names it on both ends."""
    return kind(what, 0, mb, peer, 0.0, 2 * mb + (what == GRAD))


def program(rank, stage, *actions, group=None):
    """Rank `rank`'s program: `actions`, then its stage's all-reduce over `group` (alone by
    default) and its optimizer step."""
    return Program(rank, 0, stage, 0, 4, 4, 4, False,
                   (*actions, AllReduce(group or (rank,)), Optimizer()))


def F(mb, stage=0):
    return Compute("F", stage, 0, mb)


def B(mb, stage=0):
    return Compute("B", stage, 0, mb)


def same_verdict_fast(programs, scalars):
    serial = replay({p.rank: p for p in programs}, "serial", scalars=scalars)
    fast = check_orders(Orders.of_programs(programs), scalars=scalars)
    assert bool(fast) == bool(serial), (fast, serial)
    assert [line.split(":")[0] for line in fast] == [line.split(":")[0] for line in serial]


def deadlocked(programs, model, scalars=False):
    found = replay({p.rank: p for p in programs}, model, scalars=scalars)
    assert found, model
    assert found[0].startswith(f"deadlock under the {model!r} model"), found
    same_verdict_fast(programs, scalars)
    return found[0]


def safe(programs, model, scalars=False):
    assert replay({p.rank: p for p in programs}, model, scalars=scalars) == [], model
    same_verdict_fast(programs, scalars)


def test_per_pair_fifo_a_receive_issued_before_the_send_of_the_other_direction():
    """Both ranks receive before they send to each other: the pair's stream is one FIFO."""
    a = program(0, 0, F(0), message(Recv, ACT, 1, 1), message(Send, ACT, 0, 1), F(1))
    b = program(1, 0, F(1), message(Recv, ACT, 0, 0), message(Send, ACT, 1, 0), F(0))
    assert "rank 0 waits at RECV activation (p0 mb1) from rank 1" in deadlocked([a, b], "fifo")
    swapped = program(1, 0, F(1), message(Send, ACT, 1, 0), message(Recv, ACT, 0, 0), F(0))
    safe([a, swapped], "serial")


def test_per_pair_fifo_messages_are_matched_by_order_not_by_tag():
    a = program(0, 0, F(0), F(1), message(Send, ACT, 0, 1), message(Send, ACT, 1, 1))
    b = program(1, 1, message(Recv, ACT, 1, 0), message(Recv, ACT, 0, 0), F(1, 1), F(0, 1))
    for found in (replay({0: a, 1: b}, "fifo"),
                  check_orders(Orders.of_programs((a, b)))):
        assert found[0].startswith("mismatch: rank 1 receives RECV activation (p0 mb1) from "
                                   "rank 0 of iteration 0, but rank 0 sends SEND activation "
                                   "(p0 mb0)")


def test_a_receive_posted_behind_compute_waits_for_that_compute():
    """Rank 0 posts its receive from rank 1 after F1, which needs rank 2's activation; rank
    2's comes from rank 1's F2, which needs what rank 0 sends only after that receive."""
    r0 = program(0, 0, F(0), message(Recv, ACT, 1, 2), F(1), message(Recv, ACT, 3, 1),
                 message(Send, ACT, 0, 1), F(3))
    r1 = program(1, 0, F(3), message(Send, ACT, 3, 0), message(Recv, ACT, 0, 0), F(0), F(2),
                 message(Send, ACT, 2, 2))
    r2 = program(2, 0, message(Recv, ACT, 2, 1), F(2), F(1), message(Send, ACT, 1, 0))
    safe([r0, r1, r2], "fifo")
    # rank 1's send is never received: rank 0's receive waits for F1 behind it
    assert "rank 1 waits at SEND activation (p0 mb3) to rank 0" in deadlocked(
        [r0, r1, r2], "streams")


def test_the_pair_communicators_of_a_rank_run_one_at_a_time_when_they_do_not_fit_together():
    """Rank 0 posts its receive from rank 1 before the one from rank 2, and rank 1's message
    needs what rank 2's makes possible: fine while both receives can run at once."""
    r0 = program(0, 0, message(Recv, ACT, 0, 1), message(Recv, ACT, 1, 2), F(1),
                 message(Send, ACT, 1, 3), F(0))
    r1 = program(1, 0, message(Recv, ACT, 1, 3), F(1), F(0), message(Send, ACT, 0, 0))
    r2 = program(2, 0, F(1), message(Send, ACT, 1, 0))
    r3 = program(3, 0, message(Recv, ACT, 1, 0), F(1), message(Send, ACT, 1, 1))
    safe([r0, r1, r2, r3], "streams")
    assert "rank 0 waits at RECV activation (p0 mb0) from rank 1" in deadlocked(
        [r0, r1, r2, r3], "serial")


def test_the_bucket_communicator_shares_the_hardware_queue_with_the_sends():
    """Ranks 0 and 1 share a stage. Rank 0 starts the stage all-reduce (in its last B) before
    it sends that B's gradient to rank 2, and rank 1 reaches its all-reduce only after rank
    2's next activation, which needs that gradient."""
    stage = (0, 1)
    r0 = program(0, 1, B(0, 1), message(Send, GRAD, 0, 2), group=stage)
    r1 = program(1, 1, message(Recv, ACT, 1, 2), F(1, 1), B(1, 1), group=stage)
    r2 = program(2, 0, message(Recv, GRAD, 0, 0), B(0), F(1), message(Send, ACT, 1, 1))
    safe([r0, r1, r2], "streams")
    assert "rank 0 waits at the stage all-reduce of iteration 0" in deadlocked(
        [r0, r1, r2], "serial")


def test_the_clipping_sum_over_every_rank_is_read_by_the_host():
    """Rank 1 sends its last gradient after its optimizer step; rank 0 needs it before its own
    step. Only the clipping sum (a collective of every rank, read by the host before the step)
    makes that a deadlock."""
    r0 = program(0, 0, F(0), message(Send, ACT, 0, 1), message(Recv, GRAD, 0, 1), B(0))
    r1 = program(1, 1, message(Recv, ACT, 0, 0), F(0, 1), B(0, 1))
    r1 = replace(r1, actions=(*r1.actions, message(Send, GRAD, 0, 0)))
    safe([r0, r1], "serial", scalars=False)
    assert "rank 1 waits at the clipping sum of iteration 0" in deadlocked(
        [r0, r1], "streams", scalars=True)
