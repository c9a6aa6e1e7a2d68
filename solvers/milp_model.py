"""The exact re-routing model as a mixed-integer linear program: its columns and rows.

The warm start (milp_warm.py) and the decoder (milp_decode.py) read the columns this builds;
milp.py runs it on a backend (milp_backends.py).

Decisions: which live peer runs each re-routed micro-batch, the order of the ops on every
worker, and every op's start time. Constraints: data dependencies with p2p latency, no two ops
of a worker at once (disjunctive pairs with big-M), the memory cap (in-flight micro-batches at
each forward's start), the all-reduce of a stage after every weight gradient of that stage.
Objective: the iteration time under a global barrier; with the staggered optimizer the period,
which must hold each worker's span from its first forward to its optimizer step (iteration i+1
is iteration i shifted by the period, so that is the only constraint between iterations).

Kept small, and what it leaves out:
- each worker runs one pipeline's micro-batches of one kind in index order (micro-batches of a
  pipeline are identical, so this only removes relabellings); with that, many pairs of ops need
  no order variable at all;
- peers that are interchangeable (their logical pipelines have the same holes) are used in
  order of their index by the first stage with holes (symmetry breaking);
- memory constraints are left out on workers that cannot exceed their cap anyway;
- every op starts within a horizon of twice the warm start's iteration time;
- the objective is bounded below by the analytic lower bound (a valid inequality that lifts
  the LP bound).
The optimum is therefore exact over schedules of those shapes; the tests compare it with an
exhaustive search over all orders on the instances where one is feasible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recycle_planner.job.policy import Policy, budget_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, F, I, W, OpSpace, Worker, worker_at, worker_index
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.linear_model import INF, Expr, LinearModel
from recycle_planner.timing.simulate import Simulation


@dataclass(frozen=True)
class Unit:
    """One micro-batch of one pipeline at one virtual stage (`s`; the stage itself with one
    chunk per worker), and the workers that may run it (the live peers of the stage that
    holds it, for a re-routed one)."""

    d: int
    s: int
    m: int
    candidates: tuple[int, ...]   # worker indices (worker_index)
    rerouted: bool



class ReroutingModel:
    """The MILP of one failure situation: `T[unit, kind]` start times, `x[unit, worker]` peer
    choices, `y[worker, op, op]` orders, `t_ar[stage]`, `start[worker]` and the objective `z`."""

    def __init__(self, spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                 warm: Simulation | None = None):
        self.spec, self.policy, self.failed = spec, policy, tuple(failed)
        S, D, M = spec.stages, spec.pipelines, spec.microbatches
        self.space = OpSpace.of(spec)
        self.holder = self.space.holder.tolist()
        self.kinds = (F, I, W) if policy.decouple else (F, B)
        self.release = W if policy.decouple else B
        dead = set(failed)
        self.live = [worker_index(S, d, s) for d in range(D) for s in range(S)
                     if (d, s) not in dead]
        self.units: list[Unit] = []
        for d in range(D):
            for u in range(spec.virtual_stages):
                s = self.holder[u]
                peers = tuple(worker_index(S, p, s) for p in range(D) if (p, s) not in dead)
                rerouted = (d, s) in dead
                for m in range(M):
                    self.units.append(Unit(d, u, m, peers if rerouted else (worker_index(S, d, s),),
                                           rerouted))
        self.costs = {F: spec.forward, I: spec.backward_input, W: spec.backward_weight,
                      B: spec.backward}
        self.warm = warm
        if warm is not None:
            ref = warm.steady if policy.stagger else warm.timing
            self.horizon = float(max(2 * warm.iteration_time, np.nanmax(ref.end))) + 1.0
        else:
            work = sum(sum(self.costs[k][u] for k in self.kinds)
                       for u in range(spec.virtual_stages)) * M * D
            self.horizon = float(work + sum(spec.allreduce) + sum(spec.optimizer)) + 1.0
        self.model = LinearModel()
        self._build()

    def op_id(self, op: tuple[int, int]) -> int:
        """The OpSpace id of op (unit, kind)."""
        un = self.units[op[0]]
        return self.space.compute(op[1], un.d, un.s, un.m)

    def dur(self, unit: Unit, kind: int) -> float:
        return self.costs[kind][unit.s]

    def _build(self) -> None:
        mdl, spec, H = self.model, self.spec, self.horizon
        S, last_stage = spec.stages, spec.virtual_stages - 1
        p2p = spec.p2p
        self.T: dict[tuple[int, int], int] = {}
        for u, unit in enumerate(self.units):
            for k in self.kinds:
                self.T[u, k] = mdl.var(0.0, H)
        # Assignment of re-routed units.
        self.x: dict[tuple[int, int], int] = {}
        for u, unit in enumerate(self.units):
            if unit.rerouted:
                for p in unit.candidates:
                    self.x[u, p] = mdl.binary()
                mdl.row({self.x[u, p]: 1.0 for p in unit.candidates}, 1.0, 1.0)
        index = {(un.d, un.s, un.m): i for i, un in enumerate(self.units)}
        bwd = self.kinds[1]
        # Data dependencies.
        for u, un in enumerate(self.units):
            T = self.T
            if un.s > 0:
                v = index[un.d, un.s - 1, un.m]
                mdl.row({T[u, F]: 1, T[v, F]: -1}, self.dur(self.units[v], F) + p2p[un.s - 1])
            mdl.row({T[u, bwd]: 1, T[u, F]: -1}, self.dur(un, F))
            if un.s < last_stage:
                v = index[un.d, un.s + 1, un.m]
                mdl.row({T[u, bwd]: 1, T[v, bwd]: -1}, self.dur(self.units[v], bwd) + p2p[un.s + 1])
            if self.policy.decouple:
                mdl.row({T[u, W]: 1, T[u, I]: -1}, self.dur(un, I))
        # Ops that may share each worker.
        on: dict[int, list[int]] = {w: [] for w in self.live}
        for u, un in enumerate(self.units):
            for p in un.candidates:
                on[p].append(u)
        self.on = on
        self.y: dict[tuple[int, tuple[int, int], tuple[int, int]], int] = {}
        for p, units in on.items():
            self._disjunctive(p, units)
            self._monotone(p, units)
        self._memory(on)
        # All-reduce after every weight gradient of the stage; objective.
        self.t_ar = {}
        for s in range(S):
            if not any(worker_at(S, w)[1] == s for w in self.live):
                continue
            self.t_ar[s] = mdl.var(0.0, H)
            for u, un in enumerate(self.units):
                if self.holder[un.s] == s:
                    last = self.kinds[-1]
                    mdl.row({self.t_ar[s]: 1, self.T[u, last]: -1}, self.dur(un, last))
        self.z = mdl.var(0.0, INF, cost=1.0)
        lb = lower_bound(spec, self.policy, self.failed).value
        mdl.lb[self.z] = lb
        self.start: dict[int, int] = {}
        for w in self.live:
            s = worker_at(S, w)[1]
            tail = spec.allreduce[s] + spec.optimizer[s]
            if self.policy.stagger:
                self.start[w] = mdl.var(0.0, H)
                mdl.row({self.z: 1, self.t_ar[s]: -1, self.start[w]: 1}, tail)
                for u in on[w]:
                    un = self.units[u]
                    if un.rerouted:
                        mdl.row({self.start[w]: 1, self.T[u, F]: -1, self.x[u, w]: H}, -INF, H)
                    else:
                        mdl.row({self.start[w]: 1, self.T[u, F]: -1}, -INF, 0.0)
            else:
                mdl.row({self.z: 1, self.t_ar[s]: -1}, tail)
        self._symmetry()

    def presence(self, u: int, p: int) -> Expr:
        """1 if unit u runs on worker p (a constant for fixed units)."""
        if self.units[u].rerouted:
            return Expr({self.x[u, p]: 1.0})
        return Expr(const=1.0)

    def fixed_order(self, a: tuple[int, int], b: tuple[int, int]) -> bool | None:
        """True if op a = (unit, kind) must run before op b on a shared worker, False if after,
        None if either order is possible."""
        ua, ka = a
        ub_, kb = b
        A, Bu = self.units[ua], self.units[ub_]
        if ua == ub_:
            return self.kinds.index(ka) < self.kinds.index(kb)
        if (A.d, A.s) != (Bu.d, Bu.s):
            return None
        first, second = (a, b) if A.m < Bu.m else (b, a)
        k1, k2 = first[1], second[1]
        # Index order per kind, plus what follows from it through each unit's own chain.
        rank = {F: 0, I: 1, B: 1, W: 2}
        if rank[k1] <= rank[k2]:
            return first == a
        return None

    def _disjunctive(self, p: int, units: list[int]) -> None:
        mdl = self.model
        ops = [(u, k) for u in units for k in self.kinds]
        for i in range(len(ops)):
            a = ops[i]
            for j in range(i + 1, len(ops)):
                b = ops[j]
                if a[0] == b[0]:
                    continue  # one unit's own chain: ordered by its dependencies
                both = self.presence(a[0], p).add(self.presence(b[0], p))
                relax = Expr(const=2.0).add(both, -1.0)      # 0 when both run on p
                order = self.fixed_order(a, b)
                if order is not None:
                    first, second = (a, b) if order else (b, a)
                    self._before(first, second, relax)
                    continue
                y = mdl.binary()
                self.y[p, a, b] = y
                self._before(a, b, relax.add(Expr({y: -1.0}, 1.0)))
                self._before(b, a, relax.add(Expr({y: 1.0})))

    def _monotone(self, p: int, units: list[int]) -> None:
        """Order variables between two index-ordered chains on one worker are monotone: if
        X_{a+1} runs before Y_b then so does X_a, and X_a before Y_b implies X_a before
        Y_{b+1}. Implied by integrality, not by the big-M relaxation, so they lift the LP
        bound. Only between ops that always run on p (a re-routed chain may have gaps)."""
        fixed = [u for u in units if not self.units[u].rerouted]
        chains: dict[tuple[int, int], list[int]] = {}
        for u in sorted(fixed, key=lambda u: self.units[u].m):
            un = self.units[u]
            for k in self.kinds:
                chains.setdefault((un.d, k), []).append(u)
        for (dx, kx), xs in chains.items():
            for (dy, ky), ys in chains.items():
                if (dx, kx) == (dy, ky):
                    continue
                for i, a in enumerate(xs):
                    for j, b in enumerate(ys):
                        here = self.order_indicator(p, (a, kx), (b, ky))
                        if not here or (a == b):
                            continue
                        if i + 1 < len(xs) and xs[i + 1] != b:
                            later = self.order_indicator(p, (xs[i + 1], kx), (b, ky))
                            self._at_least(here, later)
                        if j + 1 < len(ys) and ys[j + 1] != a:
                            after = self.order_indicator(p, (a, kx), (ys[j + 1], ky))
                            self._at_least(after, here)

    def _at_least(self, big: Expr, small: Expr) -> None:
        """big >= small, unless both are constants."""
        diff = big.add(small, -1.0)
        if diff:
            self.model.row(dict(diff), -diff.const)

    def _before(self, a: tuple[int, int], b: tuple[int, int], relax: Expr) -> None:
        """T[b] >= T[a] + dur(a) - H * relax (relax is 0 when the disjunct is active)."""
        H = self.horizon
        terms = {self.T[b]: 1.0}
        terms[self.T[a]] = terms.get(self.T[a], 0.0) - 1.0
        for k, v in relax.items():
            terms[k] = terms.get(k, 0.0) + H * v
        self.model.row(terms, self.dur(self.units[a[0]], a[1]) - H * relax.const)

    def order_indicator(self, p: int, a: tuple[int, int], b: tuple[int, int]) -> Expr:
        """1 if op a runs before op b on worker p (when both run there)."""
        if a[0] == b[0] or self.fixed_order(a, b) is not None:
            return Expr(const=1.0 if self.fixed_order(a, b) else 0.0)
        if (p, a, b) in self.y:
            return Expr({self.y[p, a, b]: 1.0})
        return Expr({self.y[p, b, a]: -1.0}, 1.0)

    def _memory(self, on: dict[int, list[int]]) -> None:
        """In-flight micro-batches at each forward's start stay within the cap."""
        caps = budget_caps(self.spec, self.policy)
        S = self.spec.stages
        mdl = self.model
        rel = self.release
        for p, units in on.items():
            cap = caps[worker_at(S, p)[1]]
            if len(units) <= cap:
                continue  # can never exceed the cap: no constraint needed
            for u in units:
                f = (u, F)
                terms: Expr = Expr(const=1.0)
                for v in units:
                    if v == u:
                        continue
                    held = self.order_indicator(p, (v, F), f).add(
                        self.order_indicator(p, (v, rel), f), -1.0)
                    if self.units[v].rerouted:
                        c = mdl.var(0.0, 1.0)
                        # c >= held - (1 - present(v))
                        row = {c: 1.0}
                        for k, val in held.items():
                            row[k] = row.get(k, 0.0) - val
                        row[self.x[v, p]] = row.get(self.x[v, p], 0.0) - 1.0
                        mdl.row(row, held.const - 1.0)
                        terms = terms.add(Expr({c: 1.0}))
                    else:
                        terms = terms.add(held)
                big = len(units)
                row = dict(terms)
                ub = cap - terms.const
                if self.units[u].rerouted:
                    row[self.x[u, p]] = row.get(self.x[u, p], 0.0) + big
                    ub += big
                mdl.row(row, -INF, ub)

    def _symmetry(self) -> None:
        """Interchangeable peers take re-routed work in index order (first stage with holes)."""
        S, D = self.spec.stages, self.spec.pipelines
        holes_of = {d: tuple(sorted(s for dd, s in self.failed if dd == d)) for d in range(D)}
        stages = sorted({s for _, s in self.failed})
        if not stages:
            return
        s = stages[0]
        rer = [u for u, un in enumerate(self.units) if un.rerouted and self.holder[un.s] == s]
        peers = [d for d in range(D) if (d, s) not in set(self.failed)]
        classes: dict[tuple, list[int]] = {}
        for d in peers:
            classes.setdefault(holes_of[d], []).append(worker_index(S, d, s))
        for members in classes.values():
            for i in range(1, len(members)):
                prev, cur = members[i - 1], members[i]
                for j, u in enumerate(rer):
                    row = {self.x[u, cur]: 1.0}
                    for v in rer[:j]:
                        row[self.x[v, prev]] = row.get(self.x[v, prev], 0.0) - 1.0
                    self.model.row(row, -INF, 0.0)


def estimated_pairs(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> int:
    """Roughly how many order variables the model would have (pairs of ops that may share a
    worker), without building it: how `auto` decides whether the MILP fits its budget."""
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    k = len((F, I, W) if policy.decouple else (F, B))
    dead = set(failed)
    total = 0
    for s in range(S):
        live = [d for d in range(D) if (d, s) not in dead]
        if not live:
            continue
        extra = (D - len(live)) * M  # re-routed micro-batches any live peer may take
        ops = k * (M + extra) * spec.chunks  # every chunk the stage holds
        total += len(live) * ops * (ops - 1) // 2
    return total
