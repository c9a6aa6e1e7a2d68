"""Property tests over random jobs whose workers hold several chunks (interleaved or V) and
random failure sets: every plan keeps every rule and its certificate, the array simulator
agrees with networkx longest paths, and the default policy never loses to plain re-routing."""

import networkx as nx
import pytest
from hypothesis import assume, given, settings, strategies as st

from recycle_planner.errors import SpecError
from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import JobSpec
from recycle_planner.planner import plan_situation
from recycle_planner.timing.dag import earliest_times, plan_graph
from recycle_planner.timing.validate import validate

from helpers.graphs import longest_path_length


@st.composite
def chunked_jobs(draw):
    S = draw(st.integers(1, 4))
    D = draw(st.integers(1, 3))
    M = draw(st.integers(1, 8))
    layout = draw(st.sampled_from(["interleaved", "v"]))
    chunks = 2 if layout == "v" else draw(st.integers(2, 3))
    values = st.sampled_from([0.5, 1.0, 2.0])

    def costs(options):  # a number, a value per stage or a value per virtual stage
        return draw(st.one_of(options, st.lists(options, min_size=S, max_size=S),
                              st.lists(options, min_size=S * chunks, max_size=S * chunks)))

    data = {"stages": S, "pipelines": D, "microbatches": M, "chunks": chunks,
            "time": {"forward": costs(values), "backward_input": costs(values),
                     "backward_weight": costs(st.sampled_from([0.0, 0.5, 1.0])),
                     "p2p": costs(st.sampled_from([0.0, 0.1])),
                     "allreduce": draw(st.sampled_from([0.0, 1.0])), "optimizer": 0.5}}
    if layout == "v":
        data["layout"] = "v"
    return JobSpec.from_dict(data)


@st.composite
def situations(draw):
    spec = draw(chunked_jobs())
    workers = [(d, s) for d in range(spec.pipelines) for s in range(spec.stages)]
    failed = draw(st.lists(st.sampled_from(workers), unique=True, max_size=2))
    assume(all(sum(1 for f in failed if f[1] == s) < spec.pipelines
               for s in range(spec.stages)))
    schedule = draw(st.sampled_from(["1f1b", "zb-h1"]))
    decouple = True if schedule == "zb-h1" else draw(st.booleans())
    return spec, Policy(schedule, decouple, draw(st.booleans())), tuple(failed)


def make(spec, policy, failed):
    """The plan, or the case dropped where the interleaved rounds do not divide M."""
    try:
        return plan_situation(spec, policy, failed)
    except SpecError as exc:
        assert "equal rounds" in str(exc)
        assume(False)


@settings(max_examples=30)
@given(situations())
def test_every_chunked_plan_is_valid_and_certified(case):
    plan = make(*case)
    assert validate(plan) == []
    m = plan.metrics
    assert m.period >= m.lower_bound - 1e-9, "a plan beat a lower bound: the bound is wrong"
    per_unit = 3 if plan.policy.decouple else 2
    assert m.rerouted_ops == len(plan.failed) * plan.spec.microbatches * plan.spec.chunks \
        * per_unit


@settings(max_examples=20)
@given(situations())
def test_simulator_agrees_with_networkx_on_chunked_plans(case):
    plan = make(*case)
    graph = plan_graph(plan.schedule)
    assert nx.is_directed_acyclic_graph(graph)
    space = plan.schedule.space
    for op, t in earliest_times(graph).items():
        if not (isinstance(op, tuple) and op[0] == "sync"):
            assert plan.timing.start[space.id_of(op)] == pytest.approx(t, abs=1e-9)
    assert longest_path_length(graph) == pytest.approx(plan.metrics.iteration_time)


@settings(max_examples=20)
@given(chunked_jobs(), st.data())
def test_default_never_loses_to_plain_rerouting_with_chunks(spec, data):
    assume(spec.pipelines >= 2)
    failed = ((data.draw(st.integers(0, spec.pipelines - 1)),
               data.draw(st.integers(0, spec.stages - 1))),)
    default = make(spec, Policy(), failed)
    plain = make(spec, BASELINE, failed)
    assert default.metrics.period <= plain.metrics.period + 1e-9
