import json
import subprocess
import sys
from pathlib import Path

import pytest

from recycle_planner.errors import RecycleError
from recycle_planner.files.export_torch import (export_torch_comms_csv, export_torch_csv,
                                                torch_comms_rows, torch_rows)
from recycle_planner.job.policy import Policy
from recycle_planner.planner import plan_situation
from recycle_planner.programs import compile_all

from conftest import make_spec

HELPER = Path(__file__).parent / "helpers" / "torch_csv_worker.py"


def test_rows_are_one_per_stage_in_execution_order():
    plan = plan_situation(make_spec(stages=2, pipelines=1, microbatches=4),
                          Policy("1f1b", decouple=False, stagger=False))
    assert torch_rows(plan) == [
        ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
        ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"],
    ]


def test_comms_rows_are_the_programs_order_and_failure_plans_are_refused():
    plan = plan_situation(make_spec(stages=2, pipelines=2, microbatches=2),
                          Policy("1f1b", decouple=False, stagger=False))
    programs = compile_all(plan)
    assert torch_comms_rows([programs[2], programs[3]]) == [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1",
         "0REDUCE_GRAD"],
        ["1RECV_F0", "1RECV_F1", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1",
         "1REDUCE_GRAD"]]
    failed = compile_all(plan_situation(make_spec(stages=2, pipelines=2, microbatches=2),
                                        Policy(), [(1, 1)]))
    with pytest.raises(RecycleError, match="another pipeline's: torch's format cannot"):
        torch_comms_rows([failed[0], failed[1]])


@pytest.mark.torch
def test_torch_runtime_loads_and_runs_exported_csvs(tmp_path):
    """torch's own _PipelineScheduleRuntime._load_csv accepts our CSVs, compute-only and with
    the programs' communication (fused 1F1B and ZB-H1 with I/W), and, on a 2-rank gloo run,
    gives the same losses and gradients as one process."""
    torch = pytest.importorskip("torch")
    spec = make_spec(stages=2, pipelines=1, microbatches=4)
    csvs = []
    for name, policy in (("1f1b", Policy("1f1b", False, False)), ("zbh1", Policy("zb-h1"))):
        path = tmp_path / f"{name}.csv"
        plan = plan_situation(spec, policy)
        export_torch_csv(plan, path)
        programs = compile_all(plan)
        export_torch_comms_csv([programs[0], programs[1]], tmp_path / f"{name}.comms.csv")
        csvs += [str(path), str(tmp_path / f"{name}.comms.csv")]
    assert "1I0" in (tmp_path / "zbh1.csv").read_text()
    assert "0RECV_B0" in (tmp_path / "zbh1.comms.csv").read_text()
    procs = [subprocess.Popen([sys.executable, str(HELPER), str(r), "2", str(tmp_path / "store"),
                               str(tmp_path), *csvs]) for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    sys.path.insert(0, str(HELPER.parent))
    from torch_csv_worker import data, model

    ref = model()
    x, y = data(8)
    losses = [torch.nn.functional.mse_loss(ref(xb), yb) for xb, yb in zip(x.chunk(4), y.chunk(4))]
    (sum(losses) / 4).backward()
    ref_grads = [[p.grad.flatten().tolist() for p in part.parameters()]
                 for part in (ref[0], ref[2])]
    for path in csvs:
        assert ranks[1][path]["losses"] == pytest.approx([l.item() for l in losses], rel=1e-5)
        for r in range(2):
            for got, want in zip(ranks[r][path]["grads"], ref_grads[r]):
                assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
