import pytest

from recycle_planner.errors import SpecError
from recycle_planner.job.spec import JobSpec, load_spec

from conftest import EXAMPLES

MINIMAL = """\
stages = 4            # S
pipelines = 2         # D: data-parallel degree
microbatches = 8      # M per pipeline per iteration
[time]                # milliseconds; a number applies to every stage, a list gives one value per stage
forward = 1
backward_input = 1
backward_weight = 1
p2p = 0               # activation or gradient transfer between two workers
allreduce = 0         # per-stage gradient all-reduce
optimizer = 0         # per-stage optimizer step
"""


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_minimal_file_from_the_issue_is_accepted(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL))
    assert (spec.stages, spec.pipelines, spec.microbatches) == (4, 2, 8)
    assert spec.forward == (1.0,) * 4 and spec.backward == (2.0,) * 4
    assert spec.memory is None and spec.caps() == (None,) * 4


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_examples_load_and_round_trip(path):
    spec = load_spec(path)
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_lists_give_one_value_per_stage(tmp_path):
    text = MINIMAL.replace("forward = 1", "forward = [1, 2, 3, 4.5]")
    spec = load_spec(write(tmp_path, text))
    assert spec.forward == (1, 2, 3, 4.5)
    assert spec.to_dict()["time"]["forward"] == [1, 2, 3, 4.5]
    assert spec.to_dict()["time"]["backward_input"] == 1


@pytest.mark.parametrize("change, message", [
    (("stages = 4", "stages = 0"), "'stages' must be at least 1"),
    (("stages = 4", "stages = 2.5"), "'stages' must be a whole number"),
    (("stages = 4", "stages = true"), "'stages' must be a whole number"),
    (("pipelines = 2", "pipelines = 'two'"), "'pipelines' must be a whole number"),
    (("microbatches = 8", ""), "missing key 'microbatches'"),
    (("forward = 1", "forward = 0"), "'time.forward' must be positive"),
    (("forward = 1", "forwrd = 1"), "unknown key 'time.forwrd'"),
    (("p2p = 0", "p2p = -1"), "'time.p2p' must be zero or more"),
    (("forward = 1", "forward = [1, 2]"), "'time.forward' lists 2 values but there are 4 stages"),
    (("forward = 1", "forward = [1, 2, -3, 4]"), "'time.forward[2]' must be positive"),
    (("forward = 1", "forward = 'fast'"), "'time.forward' must be a number"),
    (("stages = 4", "stages = 4\nstage = 3"), "unknown key 'stage'"),
    (("[time]", "[times]"), "unknown key 'times'"),
    (("forward = 1", "forward = nan"), "'time.forward' must be finite"),
    (("forward = 1", "forward = 1e308"), "'time.forward' must be at most 1000000000"),
    (("microbatches = 8", "microbatches = 10000000000"), "more than the planner handles"),
    (("stages = 4", "stages = 100000000"), "more than the planner handles"),
])
def test_bad_values_name_the_key(tmp_path, change, message):
    path = write(tmp_path, MINIMAL.replace(*change))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_memory_model_with_units_and_caps(tmp_path):
    text = MINIMAL + '[memory]\nactivation = "2GiB"\nstatic = [10e9, 8e9, 8e9, 12e9]\nbudget = "24GB"\n'
    spec = load_spec(write(tmp_path, text))
    assert spec.memory.activation == (2 * 2**30,) * 4
    assert spec.caps() == (6, 7, 7, 5)
    text = MINIMAL + "[memory]\nmax_inflight = 3\n"
    assert load_spec(write(tmp_path, text)).caps() == (3,) * 4
    text = MINIMAL + "[memory]\nactivation = 1e-300\nbudget = 1e300\n"  # room overflows
    assert min(load_spec(write(tmp_path, text)).caps()) >= 2**62


@pytest.mark.parametrize("memory, message", [
    ('activation = "2GiB"', "'memory.budget' is needed with 'memory.activation'"),
    ('budget = "2GiB"', "'memory.activation' is needed with 'memory.budget'"),
    ('activation = 10\nbudget = 5', "leaves stage 0 no room"),
    ('max_inflight = 0', "'memory.max_inflight' must be at least 1"),
    ('activation = "2 parsecs"\nbudget = 1', "'memory.activation' must be a number of bytes"),
    ('static = 1', "'memory.static' needs"),
    ('ram = 1', "unknown key 'memory.ram'"),
    ('activation = "1GiB"\nbudget = "1e400GiB"', "'memory.budget' must be finite"),
])
def test_bad_memory_model(tmp_path, memory, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, MINIMAL + "[memory]\n" + memory + "\n"))


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(SpecError, match="invalid TOML"):
        load_spec(write(tmp_path, "stages = [\n"))
