import gzip
import json
from dataclasses import replace

import numpy as np
import pytest

from recycle_planner.errors import PlanFileError
from recycle_planner.files.planfile import plan_to_dict, read_plan, write_plan
from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.timing.metrics import Metrics
from recycle_planner.timing.plan import Plan
from recycle_planner.timing.validate import validate

from conftest import make_spec


@pytest.fixture(scope="module")
def plan():
    return plan_situation(make_spec(pipelines=3, p2p=0.1), Policy(), [(1, 0)])


def test_core_fields_as_the_issue_specifies(plan):
    data = plan_to_dict(plan)
    assert data["format"] == "recycle-plan" and data["version"] == 3
    assert data["spec"] == {"stages": 4, "pipelines": 3, "microbatches": 8,
                            "time": {"forward": 1, "backward_input": 1, "backward_weight": 1,
                                     "p2p": 0.1, "allreduce": 0, "optimizer": 0}}
    assert data["failed"] == [[1, 0]]
    worker = data["workers"][0]
    assert set(worker) >= {"pipeline", "stage", "ops"}
    assert set(worker["ops"][0]) == {"kind", "pipeline", "stage", "chunk", "microbatch",
                                     "start", "end"}
    assert {"iteration_time", "period", "fault_free_period", "degradation",
            "lower_bound"} <= set(data["metrics"])
    assert {(w["pipeline"], w["stage"]) for w in data["workers"]} == \
        {(d, s) for d in range(3) for s in range(4)} - {(1, 0)}
    rerouted = [op for w in data["workers"] for op in w["ops"]
                if op["microbatch"] is not None and op["pipeline"] != w["pipeline"]]
    assert len(rerouted) == 8 * 3 and all(op["pipeline"] == 1 and op["stage"] == 0 for op in rerouted)
    json.dumps(data, allow_nan=False)


@pytest.mark.parametrize("name", ["plan.json", "plan.json.gz"])
def test_round_trip(plan, tmp_path, name):
    path = tmp_path / name
    write_plan(plan, path)
    back = read_plan(path)
    assert back.spec == plan.spec and back.failed == plan.failed and back.policy == plan.policy
    assert all(np.array_equal(a, b) for a, b in zip(back.schedule.orders, plan.schedule.orders))
    assert np.allclose(back.timing.start, plan.timing.start, equal_nan=True)
    assert back.metrics == plan.metrics
    assert validate(back) == []
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left
    if name.endswith(".gz"):
        assert json.loads(gzip.decompress(path.read_bytes()))["format"] == "recycle-plan"


def corrupt(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


def test_truncated_file(plan, tmp_path):
    write_plan(plan, tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    with pytest.raises(PlanFileError, match="bad.json: not a plan file .truncated or not JSON"):
        read_plan(corrupt(tmp_path, text[: len(text) // 2]))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="oobleck-template"), "not a recycle-plan file"),
    (lambda d: d.update(version=7), "version 7 is not supported"),
    (lambda d: d.pop("workers"), "missing key 'workers'"),
    (lambda d: d["workers"][0]["ops"][0].update(kind="X"), r"workers\[0\].ops\[0\]: unknown kind 'X'"),
    (lambda d: d["workers"][2].update(stage=9), r"workers\[2\]: 'stage' must be a whole number from 0 to 3"),
    (lambda d: d["workers"][1]["ops"][3].update(start="soon"), r"workers\[1\].ops\[3\]: 'start' must be a number"),
    (lambda d: d.update(failed=[[0, 0], [1, 0], [2, 0]]), "every worker of stage 0 is dead"),
    (lambda d: d["spec"]["time"].update(forward=-1), "'time.forward' must be positive"),
    (lambda d: d["metrics"].update(period=None), "metrics.period must be a number"),
    (lambda d: d["metrics"].pop("lower_bound"), "metrics.lower_bound must be a number"),
    (lambda d: d["metrics"].update(optimal="yes"), "metrics.optimal must be true or false"),
    (lambda d: d["metrics"].update(ops=True), "metrics.ops must be a number"),
    (lambda d: d["metrics"].update(lower_bound_reason=3), "metrics.lower_bound_reason must be a string"),
    (lambda d: d.update(metrics=[]), "'metrics' must be an object"),
    (lambda d: d["workers"].append(d["workers"][0]), "appears twice"),
    (lambda d: d["policy"].update(decouple="false"), "'policy.decouple' must be a boolean"),
    (lambda d: d["policy"].update(schedule="zb-h2"), "unknown schedule 'zb-h2'"),
    (lambda d: d.update(policy=[]), "'policy' must be an object"),
])
def test_foreign_or_inconsistent_file(plan, tmp_path, mutate, message):
    data = plan_to_dict(plan)
    mutate(data)
    path = corrupt(tmp_path, json.dumps(data))
    with pytest.raises(PlanFileError, match=message) as err:
        read_plan(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_metrics_keep_the_plan_file_format(plan):
    """Metrics.to_dict writes the keys the plan file always had; what a hand-made file leaves
    out stays out, and a library entry repeats only its figures."""
    data = plan.metrics.to_dict()
    assert list(data)[:8] == ["iteration_time", "period", "fault_free_period", "degradation",
                              "lower_bound", "lower_bound_reason", "gap", "optimal"]
    assert Metrics.from_dict(data) == plan.metrics
    bare = {k: data[k] for k in ("iteration_time", "period", "fault_free_period", "degradation",
                                 "lower_bound")}
    assert Metrics.from_dict(dict(bare, future_figure=1)).to_dict() == bare
    assert set(plan.metrics.entry().to_dict()) == set(bare) | {"gap", "optimal"}


def test_not_json_at_all(tmp_path):
    with pytest.raises(PlanFileError, match="not a plan file"):
        read_plan(corrupt(tmp_path, "\x00\x01 binary"))
    with pytest.raises(PlanFileError, match="not a recycle-plan file"):
        read_plan(corrupt(tmp_path, "[1, 2, 3]"))
    with pytest.raises(PlanFileError, match="cannot read plan file"):
        read_plan(tmp_path / "nope.json")


def test_failed_write_leaves_nothing(plan, tmp_path):
    # JSON cannot carry NaN: the write must fail cleanly
    plan = Plan(plan.schedule, plan.timing, replace(plan.metrics, throughput=float("nan")),
                plan.solver)
    with pytest.raises(ValueError):
        write_plan(plan, tmp_path / "p.json")
    assert list(tmp_path.iterdir()) == []


def test_written_files_get_the_usual_permissions(plan, tmp_path):
    import os

    write_plan(plan, tmp_path / "p.json")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "p.json").stat().st_mode & 0o777 == 0o666 & ~mask
