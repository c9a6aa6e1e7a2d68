"""What the coordinator tells its host agents is durable (`msg.Progress`) comes from what it
knows in memory: the losses it saved and the checkpoints it marked complete, seeded once
from the run folder when it starts (or takes over), never looked up on disk per pass."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.torch
pytest.importorskip("torch.distributed")

from recycle_planner.executor.control import agent as agent_module  # noqa: E402
from recycle_planner.executor.control import messages as msg  # noqa: E402
from recycle_planner.executor.control.agent import Agent, LaunchConfig  # noqa: E402
from recycle_planner.executor.control.iterations import IterationLog  # noqa: E402
from recycle_planner.executor.control.pool import HostPool  # noqa: E402
from recycle_planner.executor.control.runfolder import claim  # noqa: E402
from recycle_planner.executor.data.state import checkpoint_folder, write_manifest  # noqa: E402

STAGES = 2


def _stage_files(run, iteration: int) -> None:
    """Every stage's checkpoint file of `iteration` (what the manifest checks)."""
    for s in range(STAGES):
        folder = checkpoint_folder(run, iteration) / f"stage{s}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_text("")


def test_progress_is_told_from_memory_not_from_the_run_folder(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _stage_files(run, 5)
    write_manifest(run, 5, STAGES)       # an earlier attempt's checkpoint: the resume's start
    folder = claim(run, True, False)
    config = LaunchConfig(nproc=4, run_dir=str(run), checkpoint_every=5, lease=1.0)
    agent = Agent(config, None, folder, HostPool, 1)
    try:
        assert agent.checkpointed == 5   # seeded from disk, once
        monkeypatch.setattr(agent_module, "latest_checkpoint", _no_disk)
        agent.stages, agent.next_checkpoint = STAGES, 10
        agent.iterations = IterationLog(agent.mail, folder, 2, STAGES, 2, 5, 1.0)
        agent._publish_progress(0.0)
        assert agent.mail.get(msg.Progress) == msg.Progress(5, 5)
        _stage_files(run, 10)
        for s in range(STAGES):          # every stage reported its checkpoint of 10
            written = msg.CheckpointWritten(10, s)
            agent.mail._take(written)
        agent._checkpoints()
        agent._publish_progress(0.1)     # within a quarter lease: nothing new told
        assert agent.mail.get(msg.Progress) == msg.Progress(5, 5)
        agent._publish_progress(0.25)
        assert agent.mail.get(msg.Progress) == msg.Progress(5, 10)
        assert agent.next_checkpoint == 15
    finally:
        folder.release()


def _no_disk(run_dir):
    raise AssertionError("the run folder was read for the latest checkpoint")
