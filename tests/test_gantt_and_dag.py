import pytest

from recycle_planner.job.policy import BASELINE, Policy
from recycle_planner.job.spec import load_spec
from recycle_planner.planner import plan_situation
from recycle_planner.timing.dag import critical_path, describe_critical_path, plan_graph
from recycle_planner.views.gantt import draw_gantt
from recycle_planner.views.timeline import text_timeline

from conftest import EXAMPLES, make_spec
from helpers.graphs import job_graph, longest_path_length


@pytest.fixture(scope="module")
def plans():
    spec = make_spec(pipelines=3, p2p=0.2, allreduce=1, optimizer=0.5)
    return plan_situation(spec, Policy()), plan_situation(spec, Policy(), [(1, 2)])


def test_critical_path_ends_at_the_iteration_time(plans):
    _, fail = plans
    chain = critical_path(plan_graph(fail.schedule))
    assert chain[-1][3] == pytest.approx(fail.metrics.iteration_time)
    assert chain[0][2] == 0.0
    for (_, _, _, end), (_, _, start, _) in zip(chain, chain[1:]):
        assert start >= end - 1e-9
    text = describe_critical_path(chain)
    assert "worker" in text and "OPTIMIZER" in text


def test_job_graph_bounds_every_plan(plans):
    for plan in plans:
        bound = longest_path_length(job_graph(plan.schedule))
        assert bound <= plan.metrics.iteration_time + 1e-9


def test_text_timeline_marks_dead_and_rerouted(plans):
    text = text_timeline(plans[1], width=60)
    rows = {line.split("|")[0].strip(): line for line in text.splitlines() if "|" in line}
    assert set(rows["p1 s2"].split("|")[1]) == {"x"}
    assert any(c.islower() for c in rows["p0 s2"].split("|")[1] + rows["p2 s2"].split("|")[1])
    assert all(len(line.split("|")[1]) == 60 for line in rows.values())


def test_large_plans_show_the_involved_pipelines_first():
    spec = make_spec(stages=2, pipelines=20, microbatches=2)
    plan = plan_situation(spec, Policy(), [(13, 1)])
    text = text_timeline(plan, max_workers=4)
    assert "p13 s1 |xx" in text and "showing 2 of 20 pipelines" in text


@pytest.mark.parametrize("ext", ["png", "svg", "pdf"])
def test_gantt_formats_and_comparison(plans, tmp_path, ext):
    path = tmp_path / f"g.{ext}"
    draw_gantt(list(reversed(plans)), path)
    head = path.read_bytes()[:8]
    assert {"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF"}[ext] in head
    assert [p.name for p in tmp_path.iterdir()] == [f"g.{ext}"]


def test_default_policy_never_slower_than_plain_on_examples():
    """With one failure anywhere, every mechanism on (the default) is at most as slow as
    plain re-routing, on every bundled example: at every stage, and on the 1,024-worker
    example (uniform stages, 200k ops a plan) at its first, middle and last stage."""
    for path in sorted(EXAMPLES.glob("*.toml")):
        spec = load_spec(path)
        S = spec.stages
        for s in range(S) if spec.workers <= 256 else sorted({0, S // 2, S - 1}):
            default = plan_situation(spec, Policy(), [(1, s)])
            plain = plan_situation(spec, BASELINE, [(1, s)])
            assert default.metrics.period <= plain.metrics.period + 1e-9, (path.name, s)
