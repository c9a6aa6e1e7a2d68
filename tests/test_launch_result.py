"""The run's result as typed records: what the launcher fills is what result.json holds and
what `LaunchResult.from_dict` reads back; another layout is refused in one line."""

import json

import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.result import (Event, EventKind, GenerationRecord,
                                                     LaunchResult, Recovery, Status)


def _result() -> LaunchResult:
    events = [Event(0.0, EventKind.START, "4 workers"),
              Event(0.5, EventKind.GENERATION, "generation 1", {"gen": 1, "dead": [[1, 0]],
                                                                 "restart": 3}),
              Event(2.0, EventKind.END, "trained 6 iterations", {"status": Status.COMPLETED})]
    return LaunchResult(Status.COMPLETED, "trained 6 iterations", 6, [1.0, 0.5] * 3,
                        [0.1 * i for i in range(6)], events,
                        [Recovery("1:0", 0.4, 3, 0.9, 0.1)], None, "run", run_id="r1",
                        generations=[GenerationRecord(1, ((1, 0),), "k1-0.json.gz", 1.3,
                                                      0.04, 3, 20.0, None)])


def test_result_json_is_flat_and_reads_back_as_the_same_records():
    result = _result()
    text = json.dumps(result.to_dict())
    d = json.loads(text)
    assert d["status"] == "completed" and d["version"] == 3
    assert d["events"][1] == {"t": 0.5, "kind": "generation", "message": "generation 1",
                              "gen": 1, "dead": [[1, 0]], "restart": 3}
    assert d["recoveries"][0]["worker"] == "1:0" and d["generations"][0]["dead"] == [[1, 0]]
    back = LaunchResult.from_dict(d)
    assert back.status is Status.COMPLETED and back.events[1].kind is EventKind.GENERATION
    assert back.generations == result.generations and back.recoveries == result.recoveries
    assert [e.to_json() for e in back.events] == d["events"]


def test_another_layout_is_refused_in_one_line():
    d = _result().to_dict() | {"version": 1}
    with pytest.raises(RecycleError, match="layout version 1; this recycle-planner reads "
                                           "version 3"):
        LaunchResult.from_dict(d)
    with pytest.raises(ValueError):
        Event.from_json({"t": 0, "kind": "no such kind", "message": ""})
