"""Event-driven timing of a schedule, vectorized by dependency level.

The schedule's orders plus the data dependencies form a DAG. Kahn's algorithm cuts it into
levels (every op's predecessors lie in earlier levels); each level is then timed with a few
numpy operations, so a 200k-op plan times in well under a second. Ops left over when Kahn's
algorithm stops are a deadlock: the schedule asks some worker to wait for something that
can only happen after it.

One simulator serves both the first iteration (all workers idle at time 0) and the steady
state: iterations are chained by each worker's order (staggered optimizer) or by a global
barrier, and the period is read off once every op moves by the same amount per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from recycle_planner.errors import ScheduleError
from recycle_planner.job.spec import JobSpec
from recycle_planner.schedules.ops import AR, B, F, I, OPT, W, worker_name
from recycle_planner.schedules.schedule import Schedule

def cost_table(spec: JobSpec) -> np.ndarray:
    """cost[kind, stage] in milliseconds: by virtual stage for compute ops, by stage for the
    collectives (`OpSpace.decode`'s stage; the columns past S are unused for them)."""
    pad = (0.0,) * (spec.virtual_stages - spec.stages)
    return np.array([spec.forward, spec.backward_input, spec.backward_weight, spec.backward,
                     spec.allreduce + pad, spec.optimizer + pad], dtype=np.float64)


def data_edges(schedule: Schedule, ids: np.ndarray, loc: np.ndarray, kind: np.ndarray,
               pipe: np.ndarray, stage: np.ndarray, mb: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, destination, latency) of every data dependency among the scheduled ops, as
    positions in `ids` (`loc` maps op id -> position, -1 if absent): a forward needs the
    previous stage's forward; a backward its own forward and the next stage's backward; W its
    I; the optimizer step its all-reduce. Stages are virtual stages (the chain runs through
    every chunk in order). An absent source is an error."""
    spec, space = schedule.spec, schedule.space
    S = spec.virtual_stages
    p2p = np.asarray(spec.p2p)
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    lat: list[np.ndarray] = []

    def need(mask: np.ndarray, dep_ids: np.ndarray, latency: np.ndarray, what: str) -> None:
        here = np.flatnonzero(mask)
        dep_loc = loc[dep_ids]
        missing = dep_loc < 0
        if missing.any():
            j = int(np.flatnonzero(missing)[0])
            raise ScheduleError(f"{space.to_op(int(ids[here[j]]))} needs "
                                f"{space.to_op(int(dep_ids[j]))} ({what}), which no live "
                                f"worker runs")
        src.append(dep_loc)
        dst.append(here)
        lat.append(np.broadcast_to(np.asarray(latency, dtype=np.float64), here.shape))

    m = (kind == F) & (stage > 0)
    need(m, space.compute(F, pipe[m], stage[m] - 1, mb[m]), p2p[stage[m] - 1],
         "the previous stage's forward")
    m = (kind == I) | (kind == B)
    need(m, space.compute(F, pipe[m], stage[m], mb[m]), 0.0, "its forward")
    m = ((kind == I) | (kind == B)) & (stage < S - 1)
    nxt_i = space.compute(I, pipe[m], stage[m] + 1, mb[m])
    nxt_b = space.compute(B, pipe[m], stage[m] + 1, mb[m])
    need(m, np.where(loc[nxt_i] >= 0, nxt_i, nxt_b), p2p[stage[m] + 1],
         "the next stage's backward")
    m = kind == W
    need(m, space.compute(I, pipe[m], stage[m], mb[m]), 0.0, "its input-gradient backward")
    m = kind == OPT
    need(m, space.allreduce(pipe[m], stage[m]), 0.0, "its all-reduce")
    return (np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64),
            np.concatenate(lat))


@dataclass(frozen=True, eq=False)
class Timing:
    """Start and end time of every op, indexed by op id (NaN where the op is not scheduled)."""

    start: np.ndarray
    end: np.ndarray


class DependencyGraph:
    """One iteration of a schedule as arrays: nodes are scheduled ops (plus one virtual node per
    stage that synchronizes the all-reduce), edges carry the p2p latency."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        spec = schedule.spec
        space = schedule.space
        ids, workers = schedule.flat
        n = len(ids)
        self.ids, self.workers = ids, workers
        loc = np.full(space.size, -1, dtype=np.int64)
        loc[ids] = np.arange(n)
        if n and np.count_nonzero(loc >= 0) != n:
            dup = _first_duplicate(ids)
            raise ScheduleError(f"{space.to_op(dup)} is scheduled more than once")
        self.loc = loc
        kind, pipe, stage, mb = space.decode(ids)
        self.kind, self.pipe, self.stage, self.mb = kind, pipe, stage, mb
        dur = cost_table(spec)[kind, stage] if n else np.zeros(0)

        src, dst, lat = data_edges(schedule, ids, loc, kind, pipe, stage, mb)
        src, dst, lat = [src], [dst], [lat]

        # Worker order: each op after the previous one on the same worker.
        same = np.flatnonzero(workers[1:] == workers[:-1]) if n > 1 else np.zeros(0, np.int64)
        src.append(same)
        dst.append(same + 1)
        lat.append(np.zeros(len(same)))
        wpred = np.full(n, -1, dtype=np.int64)
        wpred[same + 1] = same

        # The all-reduce of a stage starts on all its live workers at once: a virtual node per
        # stage waits for every participant's previous op and releases every participant.
        ar = np.flatnonzero(kind == AR)
        n_nodes = n
        for s in np.unique(stage[ar]).tolist():
            v = n_nodes
            n_nodes += 1
            members = ar[stage[ar] == s]
            before = wpred[members]
            before = before[before >= 0]
            src.append(before)
            dst.append(np.full(len(before), v))
            lat.append(np.zeros(len(before)))
            src.append(np.full(len(members), v))
            dst.append(members)
            lat.append(np.zeros(len(members)))
        self.n = n
        self.n_nodes = n_nodes
        self.dur = np.concatenate([dur, np.zeros(n_nodes - n)])
        self.src = np.concatenate(src).astype(np.int64) if src else np.zeros(0, np.int64)
        self.dst = np.concatenate(dst).astype(np.int64) if dst else np.zeros(0, np.int64)
        self.lat = np.concatenate(lat).astype(np.float64) if lat else np.zeros(0)
        self.wpred = wpred
        self._levelize()

        n_workers = len(schedule.orders)
        lengths = np.array([len(o) for o in schedule.orders])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        live = lengths > 0
        self.first_of_worker = np.where(live, offsets[:-1], -1)
        self.last_of_worker = np.where(live, offsets[1:] - 1, -1)
        self.n_workers = n_workers

    def _levelize(self) -> None:
        n = self.n_nodes
        src, dst = self.src, self.dst
        indeg = np.bincount(dst, minlength=n)
        order = np.argsort(src, kind="stable")
        succ = dst[order]
        ptr = np.searchsorted(src[order], np.arange(n + 1))
        level = np.full(n, -1, dtype=np.int64)
        frontier = np.flatnonzero(indeg == 0)
        remaining = indeg.copy()
        levels = []
        depth = 0
        while frontier.size:
            level[frontier] = depth
            levels.append(frontier)
            starts, ends = ptr[frontier], ptr[frontier + 1]
            counts = ends - starts
            total = int(counts.sum())
            if total == 0:
                break
            offs = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(total)
            nxt = succ[offs]
            np.subtract.at(remaining, nxt, 1)
            frontier = np.unique(nxt[remaining[nxt] == 0])
            depth += 1
        stuck = np.flatnonzero(level < 0)
        if stuck.size:
            raise ScheduleError(self._deadlock_message(stuck))
        self.levels = levels
        # Edges grouped by the level of their destination, for timing level by level.
        elev = level[dst]
        eorder = np.argsort(elev, kind="stable")
        self._esrc, self._edst, self._elat = src[eorder], dst[eorder], self.lat[eorder]
        self._eptr = np.searchsorted(elev[eorder], np.arange(len(levels) + 1))

    def _deadlock_message(self, stuck: np.ndarray) -> str:
        space = self.schedule.space
        S = self.schedule.spec.stages
        real = stuck[stuck < self.n]
        # Report the first stuck op of each worker that has one, up to three.
        seen = []
        for node in real[np.argsort(real)].tolist():
            w = int(self.workers[node])
            if any(w == x[0] for x in seen):
                continue
            seen.append((w, node))
            if len(seen) == 3:
                break
        parts = [f"worker {worker_name(S, w)} waits at {space.to_op(int(self.ids[node]))}"
                 for w, node in seen]
        return (f"schedule deadlocks: {len(real)} ops can never start ("
                + "; ".join(parts) + ")")

    def run(self, base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of every node given the earliest start `base` of each node."""
        start = np.zeros(self.n_nodes) if base is None else base.astype(np.float64).copy()
        end = np.empty(self.n_nodes)
        esrc, edst, elat, eptr = self._esrc, self._edst, self._elat, self._eptr
        dur = self.dur
        for k, nodes in enumerate(self.levels):
            a, b = eptr[k], eptr[k + 1]
            if b > a:
                np.maximum.at(start, edst[a:b], end[esrc[a:b]] + elat[a:b])
            end[nodes] = start[nodes] + dur[nodes]
        return start, end

    def timing(self, start: np.ndarray, end: np.ndarray) -> Timing:
        size = self.schedule.space.size
        s = np.full(size, np.nan)
        e = np.full(size, np.nan)
        s[self.ids] = start[: self.n]
        e[self.ids] = end[: self.n]
        return Timing(s, e)


@dataclass(frozen=True, eq=False)
class Simulation:
    """The first iteration's times, the steady-state period of a schedule, and the times of
    one steady-state iteration (shifted to start at 0): in those, every worker's iteration
    fits in one period."""

    graph: DependencyGraph
    timing: Timing
    iteration_time: float
    period: float
    iterations_simulated: int
    converged: bool
    steady_start: np.ndarray | None = None  # starts of a steady-state iteration (None: the first's)

    @cached_property
    def schedule(self) -> Schedule:
        return self.graph.schedule

    @cached_property
    def steady(self) -> Timing:
        """One steady-state iteration's times, built on demand (only the MILP reads them)."""
        if self.steady_start is None:
            return self.timing
        n = self.graph.n
        return self.graph.timing(self.steady_start, self.steady_start + self.graph.dur[:n])


def simulate(schedule: Schedule, max_iterations: int = 48) -> Simulation:
    """Time the first iteration from an idle start, then chain iterations until the steady
    state shows: with a barrier every iteration is the first one shifted, so the period is the
    iteration time; with the staggered optimizer each worker starts its next iteration right
    after its own optimizer step."""
    graph = DependencyGraph(schedule)
    start, end = graph.run()
    n = graph.n
    iteration_time = float(end[:n].max() - start[:n].min()) if n else 0.0
    timing = graph.timing(start, end)
    if not schedule.policy.stagger or n == 0:
        return Simulation(graph, timing, iteration_time, iteration_time, 1, True)

    # Times of iteration k are a max-plus linear function of iteration k-1's, so once
    # iteration k is iteration k-c shifted by the same amount everywhere, it stays so forever.
    first, last = graph.first_of_worker, graph.last_of_worker
    live = first >= 0
    recent = [start[:n].copy()]          # the last few iterations' start times
    means = [float(start[:n].mean())]    # every iteration's mean start, for the fallback
    prev_end = end
    period = None
    converged = False
    for k in range(1, max_iterations):
        base = np.zeros(graph.n_nodes)
        base[first[live]] = prev_end[last[live]]
        start_k, prev_end = graph.run(base)
        recent = (recent + [start_k[:n].copy()])[-5:]
        means.append(float(start_k[:n].mean()))
        for cycle in range(1, min(4, len(recent) - 1) + 1):
            diff = recent[-1] - recent[-1 - cycle]
            if diff.max() - diff.min() <= 1e-9 * max(1.0, abs(float(diff.max()))):
                period = float(diff.mean()) / cycle
                converged = True
                break
        if converged:
            break
    if period is None:
        half = len(means) // 2
        period = (means[-1] - means[half]) / (len(means) - 1 - half)
    return Simulation(graph, timing, iteration_time, period, len(means), converged,
                      recent[-1] - recent[-1].min())


def _first_duplicate(ids: np.ndarray) -> int:
    uniq, counts = np.unique(ids, return_counts=True)
    return int(uniq[np.argmax(counts > 1)])
