import os

# CP-SAT stops at deterministic work limits, so its plans are the same on every machine; its
# wall-time safety net (10x the work limit by default) must never cut a run short on a loaded
# CI machine, or a deterministic test would see a wall-time result. Set before any solver
# runs, and inherited by every process the tests start.
os.environ.setdefault("RECYCLE_CP_WALL_FACTOR", "1000")
# c10d's store server looks every new client's address up (`getnameinfo`) on its one thread;
# a loopback client seen as ::ffff:127.0.0.1 is not in /etc/hosts, so each is a DNS query, and
# a resolver that drops one stops the whole store for glibc's 5 s retry, beyond the tests'
# 2-4 s leases (benchmarks/README.md, "The leader's loss on the relay at scale"). The tests
# make no DNS query of their own: one attempt with a 1 s timeout bounds such a stall at 1 s.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from recycle_planner.executor.control.etcd_local import EtcdCluster, etcd_missing
from recycle_planner.executor.control.store import EtcdStore, MemoryStore
from recycle_planner.job.spec import TIME_KEYS, JobSpec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

settings.register_profile("default", deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=600,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def make_spec(stages=4, pipelines=2, microbatches=8, memory=None, **time) -> JobSpec:
    costs = dict(forward=1, backward_input=1, backward_weight=1, p2p=0, allreduce=0, optimizer=0)
    costs.update(time)
    data = dict(stages=stages, pipelines=pipelines, microbatches=microbatches, time=costs)
    if memory is not None:
        data["memory"] = memory
    return JobSpec.from_dict(data)


def with_changes(spec: JobSpec, **changes) -> JobSpec:
    """A copy of `spec` with some top-level fields replaced, re-validated."""
    data = spec.to_dict()
    for key, value in changes.items():
        if key in TIME_KEYS:
            data["time"][key] = value
        else:
            data[key] = value
    return JobSpec.from_dict(data)


@pytest.fixture
def small_spec() -> JobSpec:
    return make_spec(pipelines=4, p2p=0.1, allreduce=1, optimizer=0.5)


@pytest.fixture(scope="module")
def etcd():
    """A one-member etcd on loopback ports for a test module; skipped with the reason when
    etcd is not installed."""
    if etcd_missing() is not None:
        pytest.skip(etcd_missing())
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture(params=["memory", "etcd"])
def store(request):
    """Each control store in turn: the embedded one and etcd (one contract for both)."""
    s = MemoryStore() if request.param == "memory" else EtcdStore(
        request.getfixturevalue("etcd").endpoints, timeout=3)
    yield s
    s.close()
