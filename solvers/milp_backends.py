"""The MILP backends: HiGHS through highspy, or PuLP with CBC or HiGHS. Each takes a
`LinearModel`, a time limit, optional warm-start values and a node limit, and returns
(status, objective, best bound, column values)."""

from __future__ import annotations

import math
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np

from recycle_planner.solvers.linear_model import INF, LinearModel


def solve_highs(model: LinearModel, time_limit: float, warm: list[float] | None,
                node_limit: int | None = None
                ) -> tuple[str, float | None, float | None, list[float] | None]:
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    if node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(node_limit))
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 1e-6)  # "optimal" should mean it
    n = len(model.lb)
    inf = highspy.kHighsInf
    lb = np.array([x if x > -INF else -inf for x in model.lb])
    ub = np.array([x if x < INF else inf for x in model.ub])
    h.addVars(n, lb, ub)
    ints = np.flatnonzero(model.integer).astype(np.int32)
    if len(ints):
        h.changeColsIntegrality(len(ints), ints,
                                np.array([highspy.HighsVarType.kInteger] * len(ints)))
    cost_idx = np.flatnonzero(model.cost).astype(np.int32)
    h.changeColsCost(len(cost_idx), cost_idx, np.array(model.cost)[cost_idx])
    starts, index, value, rlb, rub = [], [], [], [], []
    for idx, coef, lo, hi in model.rows:
        starts.append(len(index))
        index.extend(idx)
        value.extend(coef)
        rlb.append(lo if lo > -INF else -inf)
        rub.append(hi if hi < INF else inf)
    h.addRows(len(model.rows), np.array(rlb), np.array(rub), len(index),
              np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
              np.array(value, dtype=np.float64))
    if warm is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(warm)
        sol.value_valid = True
        h.setSolution(sol)
    _run_interruptibly(h)
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    has = info.primal_solution_status == 2  # feasible
    if status in ("Time limit reached", "Solution limit reached"):
        what = "time" if status.startswith("Time") else "node"
        status = f"Feasible (stopped at the {what} limit)" if has else \
            f"No solution (stopped at the {what} limit)"
    objective = info.objective_function_value if has else None
    bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
    values = list(h.getSolution().col_value) if has else None
    return status, objective, bound, values


def _run_interruptibly(h) -> None:
    """Solve in HiGHS's own thread and wait in short steps, so that Ctrl-C reaches Python at
    once: HiGHS is told to stop, and KeyboardInterrupt goes on (h.run() would hold it until the
    time limit)."""
    h.HandleUserInterrupt = True  # lets cancelSolve() stop the solver at its next check
    h.startSolve()
    try:
        while not h.wait(0.1)[0]:
            pass
    except KeyboardInterrupt:
        h.cancelSolve()
        h.wait()
        raise


PULP_STATUS = {1: "Optimal", 2: "Feasible (stopped at the time limit)", 0: "Not solved",
               -1: "Infeasible", -2: "Unbounded", -3: "Undefined"}


def solve_pulp(model: LinearModel, time_limit: float, warm: list[float] | None, which: str,
               node_limit: int | None = None
               ) -> tuple[str, float | None, float | None, list[float] | None]:
    """The same model through PuLP, with CBC or HiGHS. PuLP calls a time-limited stop
    'Optimal', so the status is read from its solution status instead."""
    import pulp

    prob = pulp.LpProblem("rerouting", pulp.LpMinimize)
    cols = []
    for i in range(len(model.lb)):
        cat = pulp.LpInteger if model.integer[i] else pulp.LpContinuous
        lo = model.lb[i] if model.lb[i] > -INF else None
        hi = model.ub[i] if model.ub[i] < INF else None
        v = prob.add_variable(f"c{i:07d}", lo, hi, cat=cat)
        if warm is not None:
            v.setInitialValue(round(warm[i]) if model.integer[i] else warm[i])
        cols.append(v)
    prob += pulp.lpSum(c * cols[i] for i, c in enumerate(model.cost) if c)
    for r, (idx, coef, lo, hi) in enumerate(model.rows):
        expr = pulp.LpAffineExpression([(cols[i], c) for i, c in zip(idx, coef)])
        if lo == hi:
            prob += (expr == lo, f"r{r}")
        else:
            if lo > -INF:
                prob += (expr >= lo, f"r{r}l")
            if hi < INF:
                prob += (expr <= hi, f"r{r}u")
    bound = None
    if which == "pulp-cbc":
        with tempfile.TemporaryDirectory() as tmp:
            logfile = Path(tmp) / "cbc.log"
            with warnings.catch_warnings():
                # PuLP 3 marks its bundled CBC as deprecated for 4.0 (pinned below 4).
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit,
                                           warmStart=warm is not None, logPath=str(logfile),
                                           threads=1, gapRel=1e-6,
                                           options=[f"maxNodes {node_limit}"] if node_limit else [])
                prob.solve(solver)
            text = logfile.read_text() if logfile.exists() else ""
        found = re.findall(r"best possible[: ]+(-?[0-9.eE+]+)", text) or \
            re.findall(r"Lower bound[: ]+(-?[0-9.eE+]+)", text)
        if found:
            bound = float(found[-1])
    else:
        class WarmHiGHS(pulp.HiGHS):
            """PuLP's HiGHS interface with the variables' initial values as a warm start."""

            def callSolver(self, lp):
                if warm is not None:
                    import highspy

                    sol = highspy.HighsSolution()
                    values = [0.0] * lp.solverModel.getNumCol()
                    for var in lp.variables():
                        values[var.index] = var.varValue if var.varValue is not None else 0.0
                    sol.col_value = values
                    sol.value_valid = True
                    lp.solverModel.setSolution(sol)
                lp.solverModel.run()

        extra = {"mip_max_nodes": int(node_limit)} if node_limit else {}
        prob.solve(WarmHiGHS(msg=False, timeLimit=time_limit, threads=1, gapRel=1e-6, **extra))
        b = prob.solverModel.getInfo().mip_dual_bound
        bound = b if math.isfinite(b) else None
    status = PULP_STATUS.get(prob.sol_status, str(prob.sol_status))
    values = [v.value() for v in cols]
    has = prob.sol_status in (1, 2) and all(v is not None for v in values)
    objective = pulp.value(prob.objective) if has else None
    if prob.sol_status == 1:  # a completed search: its best bound is the optimum
        bound = objective
    return status, objective, bound, ([float(v) for v in values] if has else None)


# The backends by name (SolverSettings checks a name against these keys).
BACKENDS = {
    "highs": solve_highs,
    "pulp-cbc": lambda model, limit, warm, nodes: solve_pulp(model, limit, warm, "pulp-cbc", nodes),
    "pulp-highs": lambda model, limit, warm, nodes: solve_pulp(model, limit, warm, "pulp-highs",
                                                               nodes),
}
