"""The exact re-routing model as a constraint program, solved by OR-Tools CP-SAT.

The same problem as the MILP (milp.py), written the way CP-SAT reasons best about schedules:
- every op (F, I, W or fused B of one micro-batch at one stage) is an interval; a re-routed
  micro-batch has one optional interval per live peer for each of its ops, and exactly one
  peer is present (the peer choice);
- one no-overlap per live worker over every interval that may run there;
- the memory cap: per worker, a cumulative of capacity cap over one "in flight" interval per
  micro-batch, from its forward's start to its weight-gradient (or fused backward) end;
- data dependencies with the p2p latency; the all-reduce of a stage after every backward of
  the stage, on all its workers at once, then the optimizer step;
- objective: with a barrier the iteration time; with the staggered optimizer the period,
  which must hold each worker's span from its first forward to its optimizer step (iteration
  i+1 is iteration i shifted by the period);
- the analytic lower bound (bounds.py) bounds the objective from below, so a warm start that
  meets it is proven at once.
Only true symmetries are broken: the forwards of a pipeline's micro-batches start in index
order at stage 0 (micro-batches are interchangeable), and interchangeable peers take the first
failed stage's re-routed work in index order.

Relaxed bounds: the same model with only some stages' workers as machines (no-overlap, memory
cap, span) and every other op a mere delay of its cost is a relaxation: every schedule of the
job is one of it, so its optimum (or its proven bound) is a lower bound on the period. Far
fewer machines make it far easier to prove, and micro-batches whose paths meet the same
machines become interchangeable: they are ordered where they first meet one. (4x2x8, unit
costs, workers 0:1 and 1:2 dead, fused backward, barrier: kept to stages 1 and 2, the two
workers that run all 16 micro-batches, "nothing under 55" takes 0.02 deterministic seconds;
the whole model did not decide it in 400.) Unlike the MILP, nothing fixes the order of
micro-batches on a worker, so CP-SAT's optimum is over every schedule (the tests compare it with
exhaustive search).

Times are integers in CP-SAT: costs are scaled by the smallest power of ten (up to 10^4) that
makes them whole; where none does they are rounded down, so the engine's bound stays a valid
lower bound (its plans are re-timed by the simulator in any case, never taken from the model).
Deterministic: a fixed seed and worker count (interleaved search) and a limit in CP-SAT's
deterministic time; the wall-time limit is only a safety net that a normal run does not reach.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from recycle_planner.errors import RecycleError
from recycle_planner.job.policy import Policy, budget_caps
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import B, F, I, W, OpSpace, Worker, worker_at, worker_index
from recycle_planner.schedules.schedule import Schedule, with_collectives
from recycle_planner.solvers.bounds import lower_bound
from recycle_planner.solvers.chains import busiest_load
from recycle_planner.solvers.grid import model_scale
from recycle_planner.solvers.milp import MilpResult
from recycle_planner.timing.simulate import Simulation, simulate

# CP-SAT's search: one worker (deterministic; on the benchmark instances eight interleaved
# workers proved nothing more for twice the CPU) without the LP relaxation (its bound is the
# analytic one here, and it cost up to ten times the CPU per conflict), and the seed.
CP_WORKERS = 1
# Where the one-worker minimisation leaves a gap and the probes' share of the budget is at
# least this many deterministic seconds (the benchmark's 30 per instance: 15; auto's 1 per
# situation and plan's 10 never are), half of what is left goes to a second minimisation with
# this many workers interleaved in one thread (still deterministic), from the best plan so
# far: their large-neighbourhood search shortens plans one worker's search never reaches (the
# issue's 4x4x16 F=I=W=20: 1360 -> 1340, the optimum; one worker finds nothing below 1360 in
# 30 seconds). One worker goes first because it proves more (3x3x4: optimal in 4 seconds,
# interleaved not in 8).
INTERLEAVE_FROM = 10.0
INTERLEAVED_WORKERS = 8
INTERLEAVE_SHARE = 0.5
CP_SEED = 0
# The wall-time safety net is this many times the deterministic limit (in seconds) plus slack.
# RECYCLE_CP_WALL_FACTOR raises it where the machine is shared (the test suite sets it: a CPU
# eight times slower than usual must not turn a deterministic result into a wall-time one).
WALL_FACTOR = float(os.environ.get("RECYCLE_CP_WALL_FACTOR", "10"))
# `auto` runs the engine on jobs up to this many intervals: the GPT example (8x4x8, about
# 1,100-1,600) but not the 8x8x16 job (4,100 and more), where on this machine a few seconds of
# work neither shortened a plan nor raised a bound (benchmarks/README.md).
CP_MAX_INTERVALS = 2_000


@dataclass
class CpResult(MilpResult):
    """The MILP's result, plus the time scale the engine used."""

    scale: int
    exact: bool  # costs scaled without rounding: the bound is the model's, not a relaxation's
    work: float  # CP-SAT's deterministic seconds spent (the same on every machine)


def intervals(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> int:
    """How many intervals the model has, without building it."""
    kinds = 3 if policy.decouple else 2
    S, D, M = spec.stages, spec.pipelines, spec.microbatches
    dead = set(failed)
    total = 0
    for s in range(S):
        live = sum((d, s) not in dead for d in range(D))
        total += (live + (D - live) * live) * M * (kinds + 1)  # ops, plus the in-flight one
    return total * spec.chunks


def cp_fits(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...]) -> bool:
    """Whether `auto` should run the engine on this job."""
    return intervals(spec, policy, failed) <= CP_MAX_INTERVALS


class CpModel:
    """Builds the CP-SAT model of one failure situation and decodes its solutions, in passes:
    the time grid and horizon, the intervals (one unit per micro-batch of a pipeline at a
    virtual stage; a re-routed one has an optional interval per live peer of its stage), the
    workers' no-overlaps and memory caps, the data dependencies, the symmetries, then the
    collectives and the objective. Stages of units are virtual stages (a worker holding
    several chunks runs several of them); workers, collectives and caps are by stage."""

    def __init__(self, spec: JobSpec, policy: Policy, failed: tuple[Worker, ...],
                 warm: Simulation | None = None, below: float | None = None,
                 machine_stages: frozenset[int] | None = None):
        from ortools.sat.python import cp_model

        self.spec, self.policy, self.failed = spec, policy, tuple(failed)
        self.space = OpSpace.of(spec)
        self.holder = self.space.holder.tolist()
        self.kinds = (F, I, W) if policy.decouple else (F, B)
        self.model = cp_model.CpModel()
        ub = self._grid(warm, below)
        self._intervals()
        self.kept = set(self.live) if machine_stages is None else \
            {w for w in self.live if worker_at(spec.stages, w)[1] in machine_stages}
        self._resources()
        self._dependencies()
        if machine_stages is None:
            self._symmetry()
        else:
            self._relaxed_symmetry(self.kept)
        self._objective(ub, below)
        self.warm_state = "none"
        if warm is not None:
            self.warm_state = "used" if self._hint(warm) else "not representable"

    def _grid(self, warm: Simulation | None, below: float | None) -> int:
        """Integer durations, p2p latencies and tails on the time grid; the horizon; the
        period's upper end (returned)."""
        spec, policy = self.spec, self.policy
        costs = {F: spec.forward, I: spec.backward_input, W: spec.backward_weight,
                 B: spec.backward}
        self.scale, self.exact = model_scale(spec, policy)

        def ticks(v: float) -> int:
            return int(math.floor(v * self.scale + 1e-6))

        self.dur = {k: [ticks(c) for c in costs[k]] for k in self.kinds}  # by virtual stage
        self.p2p = [ticks(v) for v in spec.p2p]
        self.tail = [ticks(spec.allreduce[s]) + ticks(spec.optimizer[s])
                     for s in range(spec.stages)]
        V, D, M = spec.virtual_stages, spec.pipelines, spec.microbatches
        work = sum(self.dur[k][u] for k in self.kinds for u in range(V)) * M * D
        horizon = work + sum(self.tail) + sum(self.p2p) * M * D + 1
        if warm is not None:
            ref = warm.steady if policy.stagger else warm.timing
            horizon = min(horizon, int(math.ceil(max(2 * warm.iteration_time,
                                                     float(np.nanmax(ref.end))) * self.scale)) + 1)
        ub = horizon + max(self.tail)  # the period's upper end
        if policy.stagger and warm is not None:  # only a period up to the warm plan's is sought
            ub = min(ub, int(math.ceil(warm.period * self.scale - 1e-6)) + 1)
        if below is not None:  # "is there a schedule under X?"
            ub = min(ub, int(math.ceil(below * self.scale - 1e-6)) - 1)
        if policy.stagger:
            # Anchored (below), every op of a schedule of period z ends by 2z: each op of a
            # micro-batch precedes its stage-0 input backward, before z, except weight
            # gradients, which end before their stage's step, within z of that worker's first
            # forward. So this horizon cuts off no schedule the model seeks.
            horizon = 2 * max(ub, 0)
        self.horizon = horizon
        return ub

    def _intervals(self) -> None:
        """Units (d, virtual stage, mb), their candidate workers, start variables, the
        intervals each worker may run and the in-flight intervals of its memory cap."""
        spec, m = self.spec, self.model
        S, D, M = spec.stages, spec.pipelines, spec.microbatches
        dead = set(self.failed)
        self.live = [worker_index(S, d, s) for d in range(D) for s in range(S)
                     if (d, s) not in dead]
        self.units = [(d, u, mb) for d in range(D) for u in range(spec.virtual_stages)
                      for mb in range(M)]
        self.cands = {}
        for d, u, mb in self.units:
            s = self.holder[u]
            self.cands[d, u, mb] = [worker_index(S, p, s) for p in range(D)
                                     if (p, s) not in dead] \
                if (d, s) in dead else [worker_index(S, d, s)]
        self.start: dict[tuple, Any] = {}
        self.presence: dict[tuple, Any] = {}
        self.helpers: list[tuple] = []  # in-flight intervals' end and size, for the hint
        self.on: dict[int, list] = {w: [] for w in self.live}     # intervals per worker
        self.held: dict[int, list] = {w: [] for w in self.live}   # in-flight intervals
        self.count: dict[int, int] = {w: 0 for w in self.live}
        rel = self.kinds[-1]
        for unit in self.units:
            u = unit[1]
            for k in self.kinds:
                self.start[unit, k] = m.NewIntVar(0, self.horizon, "")
            cands = self.cands[unit]
            lits = []
            for w in cands:
                lit = None
                if len(cands) > 1:
                    lit = self.presence[unit, w] = m.NewBoolVar("")
                    lits.append(lit)
                self.count[w] += 1
                for k in self.kinds:
                    self.on[w].append(
                        m.NewFixedSizeIntervalVar(self.start[unit, k], self.dur[k][u], "")
                        if lit is None else m.NewOptionalFixedSizeIntervalVar(
                            self.start[unit, k], self.dur[k][u], lit, ""))
                self._held(self.held[w], unit, rel, u, lit)
            if lits:
                m.AddExactlyOne(lits)

    def _resources(self) -> None:
        """One no-overlap per kept worker, and its memory cap where it may run more units."""
        S, m = self.spec.stages, self.model
        caps = budget_caps(self.spec, self.policy)
        for w in sorted(self.kept):
            m.AddNoOverlap(self.on[w])
        for w in sorted(self.kept):
            cap = caps[worker_at(S, w)[1]]
            if self.count[w] > cap:
                m.AddCumulative(self.held[w], [1] * len(self.held[w]), cap)

    def _dependencies(self) -> None:
        """Data dependencies through the virtual stages, with the p2p latency."""
        m, st, dur, p2p = self.model, self.start, self.dur, self.p2p
        last = self.spec.virtual_stages - 1
        bwd = self.kinds[1]
        for unit in self.units:
            d, u, mb = unit
            if u > 0:
                m.Add(st[unit, F] >= st[(d, u - 1, mb), F] + dur[F][u - 1] + p2p[u - 1])
            m.Add(st[unit, bwd] >= st[unit, F] + dur[F][u])
            if u < last:
                m.Add(st[unit, bwd] >= st[(d, u + 1, mb), bwd] + dur[bwd][u + 1] + p2p[u + 1])
            if self.policy.decouple:
                m.Add(st[unit, W] >= st[unit, I] + dur[I][u])

    def _symmetry(self) -> None:
        """Micro-batch labels within a pipeline (forwards at virtual stage 0 in index order),
        and interchangeable peers."""
        for d in range(self.spec.pipelines):
            for mb in range(self.spec.microbatches - 1):
                self.model.Add(self.start[(d, 0, mb), F] <= self.start[(d, 0, mb + 1), F])
        self._peer_symmetry()

    def _objective(self, ub: int, below: float | None) -> None:
        """Each stage's all-reduce after every release of its units, on all its workers at
        once, then the step; the objective: the iteration time with a barrier, the period
        (every worker's span) with the staggered optimizer."""
        spec, policy, m = self.spec, self.policy, self.model
        S, horizon, tail, kept = spec.stages, self.horizon, self.tail, self.kept
        rel = self.kinds[-1]
        self.t_ar = {}
        for s in range(S):
            self.t_ar[s] = m.NewIntVar(0, horizon, "")
            for d in range(spec.pipelines):
                for u in (spec.virtual(s, c) for c in range(spec.chunks)):
                    for mb in range(spec.microbatches):
                        m.Add(self.t_ar[s] >= self.start[(d, u, mb), rel] + self.dur[rel][u])
        bound = lower_bound(spec, policy, self.failed).value
        lb = int(math.floor(bound * self.scale + 1e-6))
        self.z = m.NewIntVar(min(lb, max(ub, 0)), max(ub, 0), "period")
        self.first: dict[int, Any] = {}
        for w in self.live:
            s = worker_at(S, w)[1]
            if policy.stagger and w not in kept:
                continue  # relaxed: a mere delay has no span
            if policy.stagger:
                self._span(w, s)
            else:
                m.Add(self.z >= self.t_ar[s] + tail[s])
        if policy.stagger:
            # Anchor in time: a periodic schedule shifted by any amount is the same schedule.
            # Shifted so that stage 0's optimizer step ends at the period, every op still starts
            # at 0 or later (each follows a forward at virtual stage 0, which follows that
            # worker's previous step, at 0 or later), so stage 0 works in the fixed window
            # [0, z]; without this the no-overlaps have no window to reason in and no probe
            # below a period was ever decided (benchmarks/README.md).
            m.Add(self.t_ar[0] + tail[0] == self.z)
            # Redundant (each worker's span implies it): every op starts within the period
            # before its stage's step ends. Stated per op it propagates without the worker
            # choice, which helps proofs (GPT, stage 0 dead: "none under 520" proven in 6
            # deterministic seconds, undecided in 10 without) but slows the search for
            # schedules (the GPT library's plans got longer at 1 second): probes only.
            if below is not None:
                for unit in self.units:
                    s = self.holder[unit[1]]
                    m.Add(self.start[unit, F] >= self.t_ar[s] + tail[s] - self.z)
        m.Minimize(self.z)

    def _span(self, w: int, s: int) -> None:
        """With the staggered optimizer, worker w's span, from its first forward to its step,
        fits in the period and holds every op it runs."""
        m = self.model
        f = m.NewIntVar(0, self.horizon, "")
        self.first[w] = f
        m.Add(self.z >= self.t_ar[s] + self.tail[s] - f)
        # The span holds every op the worker runs (a valid cut the no-overlap alone does not
        # give a relational bound for).
        load = []
        for unit in self.units:
            if w in self.cands[unit]:
                work_u = sum(self.dur[k][unit[1]] for k in self.kinds)
                load.append(work_u if (unit, w) not in self.presence
                            else work_u * self.presence[unit, w])
        m.Add(self.t_ar[s] - f >= sum(load))
        for unit in self.units:
            if w not in self.cands[unit]:
                continue
            c = m.Add(f <= self.start[unit, F])
            if (unit, w) in self.presence:
                c.OnlyEnforceIf(self.presence[unit, w])

    def _held(self, into: list, u: tuple, rel: int, s: int, lit: Any) -> None:
        """A micro-batch's in-flight interval: forward start to release end."""
        m = self.model
        end = m.NewIntVar(0, self.horizon + self.dur[rel][s], "")
        m.Add(end == self.start[u, rel] + self.dur[rel][s])
        size = m.NewIntVar(0, self.horizon + self.dur[rel][s], "")
        self.helpers.append((u, rel, s, end, size))
        if lit is None:
            into.append(m.NewIntervalVar(self.start[u, F], size, end, ""))
        else:
            into.append(m.NewOptionalIntervalVar(self.start[u, F], size, end, lit, ""))

    def _peer_symmetry(self) -> None:
        """Interchangeable peers (their pipelines have the same holes) take the re-routed
        micro-batches of the first failed stage in order: peer j only after peer j-1."""
        S, D = self.spec.stages, self.spec.pipelines
        dead = set(self.failed)
        holes = {d: tuple(sorted(s for dd, s in self.failed if dd == d)) for d in range(D)}
        stages = sorted({s for _, s in self.failed})
        if not stages:
            return
        s = stages[0]
        rer = [u for u in self.units if self.holder[u[1]] == s and (u[0], s) in dead]
        classes: dict[tuple, list[int]] = {}
        for d in range(D):
            if (d, s) not in dead:
                classes.setdefault(holes[d], []).append(worker_index(S, d, s))
        for members in classes.values():
            for prev, cur in zip(members, members[1:]):
                for j, u in enumerate(rer):
                    earlier = [self.presence[v, prev] for v in rer[:j]]
                    if not earlier:
                        self.model.Add(self.presence[u, cur] == 0)
                    else:
                        self.model.AddBoolOr(earlier).OnlyEnforceIf(self.presence[u, cur])

    def _relaxed_symmetry(self, kept: set[int]) -> None:
        """In a relaxation, micro-batches whose candidate machines agree at every stage are
        interchangeable (a delay's worker does not matter): each class starts in index order
        where it first meets a machine. Where every class lies within one pipeline,
        interchangeable peers are broken as in the whole model (pipelines swap as blocks)."""
        S, D, M = self.spec.virtual_stages, self.spec.pipelines, self.spec.microbatches
        classes: dict[tuple, list[tuple[int, int]]] = {}
        for d in range(D):
            for mb in range(M):
                key = tuple(frozenset(w if w in kept else -1 for w in self.cands[d, s, mb])
                            for s in range(S))
                classes.setdefault(key, []).append((d, mb))
        for key, chains in classes.items():
            at = next((s for s in range(S) if key[s] != frozenset({-1})), 0)
            for (d0, m0), (d1, m1) in zip(chains, chains[1:]):
                self.model.Add(self.start[(d0, at, m0), F] <= self.start[(d1, at, m1), F])
        if all(len({d for d, _ in chains}) == 1 for chains in classes.values()):
            self._peer_symmetry()

    def _hint(self, sim: Simulation) -> bool:
        """Hint every variable with the warm plan's values; False if it is not in the model
        (times off the integer grid, or it breaks a symmetry the model fixes)."""
        timing = sim.steady if self.policy.stagger else sim.timing
        sched = sim.schedule
        S = self.spec.stages
        where = {}
        for w, order in enumerate(sched.orders):
            for op in order.tolist():
                where[op] = w
        # A pipeline's micro-batches are interchangeable: the warm plan's are relabelled so
        # that their first forwards start in index order, as the model's symmetry breaking
        # asks (a heuristic plan that ran them in another order was "not representable").
        label = {}
        for d in range(self.spec.pipelines):
            first = [float(timing.start[self.space.compute(F, d, 0, mb)])
                     for mb in range(self.spec.microbatches)]
            for new, old in enumerate(sorted(range(self.spec.microbatches),
                                             key=lambda mb: (first[mb], mb))):
                label[d, new] = old

        def op_of(k: int, u: tuple) -> int:
            return self.space.compute(k, u[0], u[1], label[u[0], u[2]])

        values = {}
        for (u, k) in self.start:
            t = float(timing.start[op_of(k, u)]) * self.scale
            values[u, k] = int(round(t))
        on_grid = bool(np.allclose(
            [float(timing.start[op_of(k, u)]) * self.scale for u, k in values],
            list(values.values()), atol=1e-6))
        ordered = all(values[(d, 0, mb), F] <= values[(d, 0, mb + 1), F]
                      for d in range(self.spec.pipelines)
                      for mb in range(self.spec.microbatches - 1))
        rel = self.kinds[-1]
        ar = {s: max(values[u, rel] + self.dur[rel][u[1]] for u in self.units
                     if self.holder[u[1]] == s) for s in self.t_ar}
        tail = {s: int(round((self.spec.allreduce[s] + self.spec.optimizer[s]) * self.scale))
                for s in range(S)}
        first, z = {}, 0
        for w in self.live:
            s = worker_at(S, w)[1]
            if self.policy.stagger:
                first[w] = min(values[u, F] for u in self.units if w in self.cands[u]
                               and (len(self.cands[u]) == 1 or where[op_of(F, u)] == w))
                z = max(z, ar[s] + tail[s] - first[w])
            else:
                z = max(z, ar[s] + tail[s])
        # The model's anchor (stagger): stage 0's step ends at the period.
        shift = z - ar[0] - tail[0] if self.policy.stagger else 0
        m = self.model
        for (u, k), var in self.start.items():
            m.AddHint(var, values[u, k] + shift)
        for (u, w), lit in self.presence.items():
            m.AddHint(lit, where[op_of(F, u)] == w)
        for u, rel_k, s, end, size in self.helpers:  # a complete hint needs no search to repair
            m.AddHint(end, values[u, rel_k] + self.dur[rel_k][s] + shift)
            m.AddHint(size, values[u, rel_k] + self.dur[rel_k][s] - values[u, F])
        for s, var in self.t_ar.items():
            m.AddHint(var, ar[s] + shift)
        for w, var in self.first.items():
            m.AddHint(var, first[w] + shift)
        m.AddHint(self.z, z)
        return on_grid and ordered

    def decode(self, solver: Any) -> Schedule:
        """Each worker's ops sorted by start time."""
        S = self.spec.stages
        per_worker: dict[int, list] = {w: [] for w in self.live}
        for u in self.units:
            cands = self.cands[u]
            w = cands[0] if len(cands) == 1 else \
                next(p for p in cands if solver.BooleanValue(self.presence[u, p]))
            for rank, k in enumerate(self.kinds):
                per_worker[w].append((solver.Value(self.start[u, k]), rank, u[2],
                                      self.space.compute(k, *u)))
        orders = []
        for w in range(self.spec.workers):
            if w not in per_worker:
                orders.append(np.zeros(0, dtype=np.int64))
                continue
            d, s = divmod(w, S)
            orders.append(with_collectives(self.space, d, s,
                                           [op for *_, op in sorted(per_worker[w])]))
        return Schedule(self.spec, self.policy, self.failed, tuple(orders))

    def size(self) -> dict[str, int]:
        proto = self.model.Proto()
        return {"variables": len(proto.variables), "constraints": len(proto.constraints),
                "optional_peers": len(self.presence)}


STATUS = {"OPTIMAL": "Optimal", "FEASIBLE": "Feasible (stopped at the work limit)",
          "INFEASIBLE": "Infeasible", "UNKNOWN": "No solution (stopped at the work limit)",
          "MODEL_INVALID": "Model invalid"}


def run_cp(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], work_limit: float,
           warm: Simulation | None = None, below: float | None = None,
           workers: int = CP_WORKERS, machine_stages: frozenset[int] | None = None
           ) -> CpResult:
    """Build, hint and solve the model within `work_limit` seconds of CP-SAT's deterministic
    time (the same answer on every machine).

    With `below`, only schedules shorter than it are sought: "Infeasible" then proves that none
    exists, which makes `below` a lower bound. With `machine_stages`, the relaxation that keeps
    only those stages' workers as machines: its bound is the job's, its plan is not."""
    from ortools.sat.python import cp_model

    if work_limit <= 0:
        raise RecycleError(f"the CP engine's work limit must be positive, got {work_limit}")
    t0 = time.perf_counter()
    model = CpModel(spec, policy, failed, warm, below, machine_stages)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.random_seed = CP_SEED
    p.num_workers = workers
    p.interleave_search = workers > 1
    p.linearization_level = 0
    p.max_deterministic_time = float(work_limit)
    p.max_time_in_seconds = WALL_FACTOR * float(work_limit) + 30.0
    p.log_search_progress = False
    code = solver.Solve(model.model)
    name = solver.StatusName(code)
    status = STATUS.get(name, name)
    has = name in ("OPTIMAL", "FEASIBLE")
    scale = model.scale
    objective = solver.ObjectiveValue() / scale if has else None
    bound = None
    if name == "OPTIMAL":
        bound = objective
    elif name == "FEASIBLE":
        bound = solver.BestObjectiveBound() / scale
    elif name == "INFEASIBLE" and below is not None:
        bound = below
    if bound is not None and not model.exact and name != "INFEASIBLE":
        status += " (costs rounded down: the bound is a relaxation's)"
    schedule = model.decode(solver) if has and machine_stages is None else None
    gap = None
    if objective and bound is not None:
        gap = max(0.0, (objective - bound) / objective)
    return CpResult(schedule, status, objective, bound, gap, time.perf_counter() - t0,
                    model.size(), model.warm_state, scale, model.exact,
                    solver.deterministic_time)


def close_gap(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], best: Simulation,
              bound: float, work: float, steps: int
              ) -> tuple[Simulation, float, list[dict[str, Any]]]:
    """Bisect the gap between `bound` and the best plan's period with up to `steps` "is there
    a schedule under X?" probes on the engine's time grid, sharing `work`: each gets the work
    left over the probes left, so a quick proof leaves more to the next. An infeasible X is a
    new bound; a schedule found under X is the new plan if the simulator agrees it is shorter;
    a probe that finds neither sends the next one lower (proofs are cheap near the bound, dear
    near the optimum). Returns the best plan, the best bound and the probes' reports."""
    scale = model_scale(spec, policy)[0]
    low = math.ceil(bound * scale - 1e-6)
    high = math.ceil(best.period * scale - 1e-6)  # "under high" is the first useful probe
    probes: list[dict[str, Any]] = []
    left = work
    for step in range(steps):
        if low >= high or left <= 1e-3:
            break
        mid = (low + high + 1) // 2
        res = run_cp(spec, policy, failed, left / (steps - step), best, below=mid / scale)
        left -= res.work
        probes.append({"under": mid / scale, "status": res.status, "work": round(res.work, 3),
                       "seconds": round(res.seconds, 3)})
        if res.status == "Infeasible":
            low = mid
            continue
        high = mid - 1
        if res.schedule is not None:
            sim = simulate(res.schedule)
            if sim.period < best.period - 1e-9:
                best = sim
    return best, max(bound, low / scale), probes


def relaxations(spec: JobSpec, failed: tuple[Worker, ...]) -> list[frozenset[int]]:
    """The stage sets relaxed_bound keeps as machines, smallest first: the stage whose busiest
    live worker has the most work, then the two such stages, and so on, up to RELAX_STAGES and
    never every stage (that is the whole model)."""
    n = busiest_load(spec, failed)
    whole = spec.one_chunk()  # a worker's chunks together
    order = sorted(range(spec.stages),
                   key=lambda s: (-n[s] * (whole.forward[s] + whole.backward[s]), s))
    return [frozenset(order[:k]) for k in range(1, min(RELAX_STAGES, spec.stages - 1) + 1)]


def relaxed_bound(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], best: Simulation,
                  bound: float, work: float) -> tuple[float, list[dict[str, Any]], float]:
    """Raise `bound` with the relaxations' bounds (CpModel's machine_stages), smallest first,
    sharing `work` as close_gap does; stops once the bound reaches the best plan's period.
    Each asks for a relaxed schedule shorter than the best plan: "Infeasible" proves the plan
    optimal, else the relaxation's own bound counts.
    Returns the bound, each relaxation's report and the work spent."""
    sets = relaxations(spec, failed)
    reports: list[dict[str, Any]] = []
    left = work
    for i, stages in enumerate(sets):
        if best.period <= bound * (1 + 1e-9) or left <= 1e-3:
            break
        res = run_cp(spec, policy, failed, left / (len(sets) - i), best, below=best.period,
                     machine_stages=stages)
        left -= res.work
        reports.append({"stages": sorted(stages), "status": res.status, "bound": res.bound,
                        "work": round(res.work, 3), "seconds": round(res.seconds, 3)})
        if res.bound is not None and res.bound > bound:
            bound = res.bound
    return bound, reports, work - left


# cp_solution's share of its work limit for the probes that close the gap, and their number;
# prove mode (plan-all --prove) gives the probes more of its larger budget. RELAX_SHARE of what
# the minimisation leaves goes to the relaxed bounds, over at most RELAX_STAGES stages, where
# that share is at least RELAX_FROM deterministic seconds: with less (auto's 1 second), none
# proved anything on the GPT library and their models' builds cost 15 s of its 58.
RELAX_SHARE = 0.25
RELAX_STAGES = 3
RELAX_FROM = 0.5
PROBE_SHARE = 0.5
PROBE_STEPS = 4
PROVE_SHARE = 0.75
PROVE_STEPS = 8


def cp_solution(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], work_limit: float,
                warm: Simulation, share: float = PROBE_SHARE, steps: int = PROBE_STEPS
                ) -> tuple[Simulation, dict[str, Any], float | None]:
    """The CP engine's plan (or the warm start when it found nothing shorter), its report and
    its proven bound: the engine minimises the period with part of the work limit (one
    worker); where that leaves a gap, the relaxations' bounds (relaxed_bound) take
    RELAX_SHARE of the rest (when that is at least RELAX_FROM); where a gap is still left and
    the budget is large, eight interleaved workers from its best plan (INTERLEAVE_FROM); then,
    while a gap is left, close_gap spends the rest on "is there a schedule under X?" probes
    (their infeasibility proofs are the bounds the minimisation alone rarely raises)."""
    res = run_cp(spec, policy, failed, work_limit * (1 - share), warm)
    best, info, bound = res.against(warm, engine="cp-sat", work_limit=work_limit,
                                    time_scale=res.scale)
    if res.status.startswith("Optimal") and res.exact:
        return best, info, bound
    left = work_limit - res.work
    start = max(bound or 0.0, lower_bound(spec, policy, failed).value)
    if best.period > start * (1 + 1e-9) and left * RELAX_SHARE >= RELAX_FROM:
        relaxed, info["relaxed"], spent = relaxed_bound(spec, policy, failed, best, start,
                                                        left * RELAX_SHARE)
        left -= spent
        if relaxed > start:
            bound = start = relaxed
            info["best_bound"] = bound
            kept = next(r["stages"] for r in info["relaxed"] if r["bound"] == relaxed)
            info["bound_from"] = "stages " + ", ".join(map(str, kept)) + " alone as machines"
    if best.period > start * (1 + 1e-9) and work_limit * share >= INTERLEAVE_FROM:
        more = run_cp(spec, policy, failed, left * INTERLEAVE_SHARE, best,
                      workers=INTERLEAVED_WORKERS)
        left -= more.work
        found, report, proven = more.against(best)
        info["interleaved"] = {k: report[k] for k in ("status", "objective", "improved")}
        info["interleaved"]["work"] = round(more.work, 3)
        if report["improved"]:
            best, info["improved"] = found, True
        if proven is not None and proven > start:
            bound = start = proven
            info["best_bound"] = bound
    if best.period > start * (1 + 1e-9):
        found, proven, probes = close_gap(spec, policy, failed, best, start, left, steps)
        info["probes"] = probes
        if found is not best:
            best = found
            info["improved"] = best.period < warm.period - 1e-9
        if proven > start:
            bound = proven
            info["best_bound"] = bound
            info["bound_from"] = f"no schedule under {proven:g}"
    if bound is not None:
        info["gap"] = max(0.0, (best.period - bound) / best.period)
    return best, info, bound


def bound_reason(info: dict[str, Any], mode: str = "") -> str:
    """Why the engine's bound holds, for the plan's lower-bound reason."""
    how = [x for x in (mode, info.get("bound_from")) if x]
    return "the CP engine's bound" + (f" ({'; '.join(how)})" if how else "")


def cp_prove(spec: JobSpec, policy: Policy, failed: tuple[Worker, ...], work_limit: float,
             warm: Simulation) -> tuple[Simulation, dict[str, Any], float | None]:
    """Prove mode (plan-all --prove): cp_solution with most of its budget on the probes."""
    return cp_solution(spec, policy, failed, work_limit, warm, PROVE_SHARE, PROVE_STEPS)
