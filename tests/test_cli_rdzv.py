"""`--rdzv-backend etcd` on `coordinator` and `launch`: each becomes a wrapper (one that
campaigns, one that follows the leader) whose child is the same command with everything else it
was given. The wrappers themselves run on a real etcd in tests/test_control_failover_training.py;
here, what they are asked to run."""

import socket
import sys

import pytest
from click.testing import CliRunner

from recycle_planner.cli.main import main
from recycle_planner.executor.control import failover

from conftest import EXAMPLES

TINY = f"{EXAMPLES / 'tiny_mlp.py'}:make_job"


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(failover, "campaign_and_coordinate",
                        lambda *a: seen.append(("campaign", *a)) or 0)
    monkeypatch.setattr(failover, "follow_leader", lambda *a: seen.append(("follow", *a)) or 7)
    return seen


CHILD = [sys.executable, "-m", "recycle_planner.cli"]


def test_a_coordinator_on_etcd_runs_itself_behind_the_election(calls, tmp_path):
    r = CliRunner().invoke(main, [
        "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port", "29411",
        "--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2:2379", "--rdzv-id", "job7",
        "--advertise", "10.0.0.9", "--run-dir", str(tmp_path / "run"), "--lease", "2",
        "--no-on-demand", "--inject-fault", "1:2:F1", "--inject-fault", "0:3:F0"])
    assert r.exit_code == 0, r.output
    assert calls == [("campaign", "e1:2379,e2:2379", "job7", 2.0, "10.0.0.9:29411", [
        *CHILD, "coordinator", "--nnodes", "2", "--nproc-per-node", "2", "--port", "29411",
        "--no-on-demand", "--run-dir", str(tmp_path / "run"), "--lease", "2.0",
        "--inject-fault", "1:2:F1", "--inject-fault", "0:3:F0"])]


def test_a_host_agent_on_etcd_follows_the_leader_with_its_own_options(calls):
    r = CliRunner().invoke(main, [
        "launch", "--nnodes", "2", "-n", "2", "--node-rank", "1", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", "e1:2379", "--rdzv-timeout", "60", TINY, "--", "--iterations", "8"])
    assert r.exit_code == 7, r.output  # the host agent's status is the command's
    assert calls == [("follow", "e1:2379", "recycle", 4.0, [
        *CHILD, "launch", "-n", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
        failover.COORDINATOR, "--rdzv-timeout", "60.0", TINY, "--", "--iterations", "8"],
        60.0, failover.HostRecord(1, socket.gethostname(), (2, 3)))]  # its lease on etcd


def test_etcd_without_its_endpoints_is_one_line(calls):
    r = CliRunner().invoke(main, ["coordinator", "--nnodes", "2", "--nproc-per-node", "2",
                                  "--rdzv-backend", "etcd"])
    assert r.exit_code == 2 and "--rdzv-backend etcd needs --rdzv-endpoint" in r.output
    assert len(r.output.strip().splitlines()) == 1 and calls == []
