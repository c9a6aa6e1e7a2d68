"""Per-rank programs: what each rank of a plan runs, in which order, with whom it communicates.

Any launcher can run a plan from here (torchtitan, Megatron-LM, a loop over
`torch.distributed`); recycle-planner's own executor runs the same programs. No torch needed.

    from recycle_planner.library import PlanLibrary
    from recycle_planner.programs import lookup_program

    program = lookup_program(PlanLibrary.open("plans/"), [(1, 3)], rank=5)  # dead: physical
    for action in program.actions: ...                   # Recv, Compute, Send, AllReduce, Optimizer

The package, one module per idea: `actions.py` (the typed actions and `Program`, with
`to_json`/`from_json`), `compile.py` (a rank's program from a plan, in time proportional to
its own ops), `order.py` (the issue order that is safe on NCCL, and why), `nccl.py` (NCCL's
rules as replay models), `check.py` (the check every stored plan passes, fast) and `files.py`
(the program files `recycle-planner program` writes, checked like plan files).
"""

from recycle_planner.programs.actions import (AllReduce, Compute, Message, Optimizer, Program,
                                              Recv, Send)
from recycle_planner.programs.check import check_orders, check_plan
from recycle_planner.programs.compile import (Orders, compile_all, compile_orders,
                                              compile_program, lookup_program, plan_index,
                                              rank_orders)
from recycle_planner.programs.nccl import replay

__all__ = ["AllReduce", "Compute", "Message", "Optimizer", "Orders", "Program", "Recv", "Send",
           "check_orders", "check_plan", "compile_all", "compile_orders", "compile_program",
           "lookup_program", "plan_index", "rank_orders", "replay"]
