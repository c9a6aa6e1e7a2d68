"""Durations, trace files (every mistake named by its line) and seeded trace sampling."""

import math

import numpy as np
import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.whatif.deadset import dead_states
from recycle_planner.whatif.durations import format_duration, parse_duration, parse_durations
from recycle_planner.whatif.trace import (FAIL, REPAIR, check_events, read_trace, sample_trace,
                                          write_trace)

from conftest import EXAMPLES, make_spec

SPEC = make_spec(stages=4, pipelines=2)


@pytest.mark.parametrize("text, seconds", [
    ("45s", 45), ("30min", 1800), ("1h30min", 5400), ("1d 2h", 93600), ("2h", 7200),
    ("7d", 604800), ("1.5h", 5400), ("2w", 1209600),
    ("250ms", 0.25), ("90", 90), (" 3 H ", 10800), ("1e3s", 1000), (12, 12),
])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, message", [
    ("2x", "unknown unit 'x'"), ("5m", "ambiguous"), ("-1h", "not a duration"),
    ("", "not a duration"), ("h", "not a duration"), ("1h30", "not a duration"),
    ("1h30x", "unknown unit 'x'"),
])
def test_bad_durations_say_why(text, message):
    with pytest.raises(RecycleError, match=message):
        parse_duration(text, "--mtbf")


def test_duration_lists_and_formatting():
    assert parse_durations("6h,2h,30min") == [21600, 7200, 1800]
    with pytest.raises(RecycleError, match="more than zero"):
        parse_durations("6h,0s")
    with pytest.raises(RecycleError, match="comma-separated"):
        parse_durations("6h,,2h")
    assert [format_duration(x) for x in (21600, 1800, 604800, 90, 5400, 0.25)] == \
        ["6h", "30min", "7d", "90s", "90min", "250ms"]


GOOD = """# a comment
time,event,worker
10,fail,1:3    # trailing comment

1h,fail,0:0
1h,repair,1:3
7200,repair,0:0
"""


def test_read_trace(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(GOOD)
    tr = read_trace(path, SPEC)
    assert [(e.time, e.kind, e.worker) for e in tr.events] == [
        (10, FAIL, (1, 3)), (3600, FAIL, (0, 0)), (3600, REPAIR, (1, 3)), (7200, REPAIR, (0, 0))]
    assert tr.duration == 7200  # the last event, without --duration
    assert read_trace(path, SPEC, duration=10000).duration == 10000
    assert tr.dead_counts() == (2, pytest.approx((3590 + 3600) / 7200))
    states = dead_states(tr)
    assert [s.per_stage for s in states] == [(0, 0, 0, 1), (1, 0, 0, 1), (1, 0, 0, 0),
                                             (0, 0, 0, 0)]
    assert states[1].per_pipeline == ((0, (0,)), (1, (3,)))


@pytest.mark.parametrize("body, line, message", [
    ("time,event\n", 1, "expected the header"),
    ("time,event,worker\n10,fail\n", 2, "expected 3 fields"),
    ("time,event,worker\nten,fail,0:0\n", 2, "not a duration"),
    ("time,event,worker\n10,crash,0:0\n", 2, "unknown event 'crash'"),
    ("time,event,worker\n10,fail,00\n", 2, "not PIPELINE:STAGE"),
    ("time,event,worker\n10,fail,2:0\n", 2, "unknown worker 2:0"),
    ("time,event,worker\n10,repair,0:0\n", 2, "repaired but is not dead"),
    ("time,event,worker\n10,fail,0:0\n20,fail,0:0\n", 3, "already dead"),
    ("time,event,worker\n20,fail,0:0\n\n10,fail,1:0\n", 4, "must be sorted"),
    ("time,event,worker\n20,fail,0:0\n5h,fail,1:0\n", 3, "after the end of the trace"),
])
def test_bad_trace_lines_are_named(tmp_path, body, line, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(RecycleError, match=message) as info:
        read_trace(path, SPEC, duration=3600 if "5h" in body else None)
    assert f"bad.csv line {line}:" in str(info.value)


def test_empty_or_missing_trace(tmp_path):
    (tmp_path / "e.csv").write_text("# nothing\n")
    with pytest.raises(RecycleError, match="empty trace"):
        read_trace(tmp_path / "e.csv", SPEC)
    (tmp_path / "h.csv").write_text("time,event,worker\n")
    with pytest.raises(RecycleError, match="give the trace's duration"):
        read_trace(tmp_path / "h.csv", SPEC)
    assert read_trace(tmp_path / "h.csv", SPEC, duration=60).events == ()
    with pytest.raises(RecycleError, match="cannot read trace"):
        read_trace(tmp_path / "missing.csv", SPEC)


def test_example_trace_is_valid():
    from recycle_planner.job.spec import load_spec

    tr = read_trace(EXAMPLES / "trace.csv", load_spec(EXAMPLES / "gpt.toml"))
    assert tr.failures >= 5 and tr.dead_counts()[0] == 3


@pytest.mark.parametrize("sampling", ["worker", "fleet"])
@pytest.mark.parametrize("distribution", ["exponential", "weibull"])
def test_sampling_is_seeded_valid_and_has_the_asked_rate(sampling, distribution):
    spec = make_spec(stages=4, pipelines=8)
    kw = dict(mtbf=3600.0, repair=1800.0, duration=2000 * 3600.0, distribution=distribution,
              shape=0.7, sampling=sampling)
    a, b = sample_trace(spec, seed=3, **kw), sample_trace(spec, seed=3, **kw)
    assert a.events == b.events
    assert sample_trace(spec, seed=4, **kw).events != a.events
    check_events(list(a.events), spec, a.duration)
    # About one failure an hour; a dead worker cannot fail, which lowers it a little.
    assert 1700 < a.failures < 2100
    assert a.source["mtbf"] == 3600.0 and a.source["seed"] == 3


def test_fixed_repairs_and_round_trip(tmp_path):
    spec = make_spec(stages=2, pipelines=2)
    tr = sample_trace(spec, 600.0, 60.0, 86400.0, seed=1, repair_distribution="fixed")
    down = {}
    for e in tr.events:
        if e.kind == FAIL:
            down[e.worker] = e.time
        else:
            assert math.isclose(e.time - down.pop(e.worker), 60.0)
    write_trace(tr, tmp_path / "t.csv")
    back = read_trace(tmp_path / "t.csv", spec, duration=tr.duration)
    assert back.events == tr.events


def test_sampling_rejects_nonsense():
    with pytest.raises(RecycleError, match="unknown distribution"):
        sample_trace(SPEC, 1.0, 1.0, 10.0, distribution="gamma")
    with pytest.raises(RecycleError, match="above zero"):
        sample_trace(SPEC, 0.0, 1.0, 10.0)
    with pytest.raises(RecycleError, match="shape"):
        sample_trace(SPEC, 1.0, 1.0, 10.0, distribution="weibull", shape=0)


def test_weibull_keeps_the_mean():
    spec = make_spec(stages=1, pipelines=1)
    tr = sample_trace(spec, 100.0, 0.0, 2e6, seed=0, distribution="weibull", shape=0.5)
    fails = np.array([e.time for e in tr.events if e.kind == FAIL])
    assert np.diff(fails).mean() == pytest.approx(100.0, rel=0.1)
