"""What the pictures say (issue 14): every re-routed op of the default GPT chart labelled, no
labels overlapping on a dense 6x3x12 chart, a readable what-if throughput plot."""

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec, load_spec
from recycle_planner.planner import plan_situation
from recycle_planner.views import gantt

from conftest import EXAMPLES


def drawn(monkeypatch, plans, tmp_path):
    """The figure draw_gantt would save, with its text drawn (to measure it)."""
    figures = []
    monkeypatch.setattr(gantt, "save_figure", lambda fig, path, fmt: figures.append(fig))
    gantt.draw_gantt(plans, tmp_path / "g.png")
    fig = figures[0]
    fig.canvas.draw()
    return fig


def labels(fig):
    renderer = fig.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes
            for t in ax.texts if t.get_text() != "dead"]


def test_rerouted_ops_of_the_gpt_chart_are_labelled(monkeypatch, tmp_path):
    plan = plan_situation(load_spec(EXAMPLES / "gpt.toml"), Policy(), [(1, 3)])
    assert plan.schedule.n_ops > gantt.LABEL_LIMIT  # the plain bars are not labelled
    texts = [t for t, _ in labels(drawn(monkeypatch, [plan], tmp_path))]
    assert len(texts) >= plan.metrics.rerouted_ops * 0.9
    assert all(t.startswith("p1") for t in texts)


def test_labels_do_not_overlap_on_a_dense_chart(monkeypatch, tmp_path):
    spec = JobSpec.from_dict({"stages": 6, "pipelines": 3, "microbatches": 12, "time": {
        "forward": 1, "backward_input": 1, "backward_weight": 1, "p2p": 0.1}})
    plan = plan_situation(spec, Policy(), [(1, 2), (0, 4)])
    boxes = labels(drawn(monkeypatch, [plan], tmp_path))
    assert sum(t.startswith("p") for t, _ in boxes) > 40
    boxes.sort(key=lambda b: (b[1].y0, b[1].x0))
    for (ta, a), (tb, b) in zip(boxes, boxes[1:]):
        if abs(a.y0 - b.y0) < 1:  # same row
            assert a.x1 <= b.x0 + 0.5, (ta, tb)


def test_throughput_plot_has_a_strip_per_strategy_and_no_offset(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from recycle_planner.cli.main import main
    from recycle_planner.whatif import plots

    small = str(EXAMPLES / "small.toml")
    r = CliRunner().invoke(main, ["plan-all", small, "-f", "1", "-o", str(tmp_path / "lib"),
                                  "-j", "1"])
    assert r.exit_code == 0, r.output
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, fmt: figures.append(fig))
    r = CliRunner().invoke(main, ["simulate-trace", small, "--library", str(tmp_path / "lib"),
                                  "--mtbf", "30min", "--duration", "7d", "--json", "-o",
                                  str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    fig = figures[0]
    fig.canvas.draw()
    strategies = len(__import__("json").loads(r.stdout)["strategies"])
    assert len(fig.axes) == strategies + 2  # failure marks, one strip each, samples trained
    for ax in fig.axes:
        assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e8" over an axis
    assert "millions" in fig.axes[-1].get_ylabel() or "billions" in fig.axes[-1].get_ylabel()
