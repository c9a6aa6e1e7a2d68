"""The pipeline as a networkx dependency DAG of ops, for critical paths and checks.

Nodes are `Op` values plus one synchronisation node per stage's all-reduce; an edge u -> v
says v cannot start before u ends, and carries the transfer latency. Two graphs:

- the job graph: data dependencies only (what any plan must respect), whose longest path is a
  lower bound on the iteration time;
- the plan graph: the job graph plus each worker's order, whose longest path is the plan's
  iteration time, and whose heaviest chain is the critical path that `show` reports.

networkx is the readable reference; the array simulator (`simulate.py`) is the fast path and
the tests check that the two agree.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from recycle_planner.schedules.ops import Op, worker_at
from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.simulate import cost_table, data_edges

SYNC = "sync"


def _nodes_and_edges(schedule: Schedule, with_order: bool) -> nx.DiGraph:
    spec, space = schedule.spec, schedule.space
    ids, workers = schedule.flat
    loc = np.full(space.size, -1, dtype=np.int64)
    loc[ids] = np.arange(len(ids))
    kind, pipe, stage, mb = space.decode(ids)
    cost = cost_table(spec)[kind, stage]
    ops = space.to_ops(ids)
    graph = nx.DiGraph()
    S = spec.stages
    for op, w, c in zip(ops, workers.tolist(), cost.tolist()):
        graph.add_node(op, duration=c, worker=worker_at(S, w))
    src, dst, lat = data_edges(schedule, ids, loc, kind, pipe, stage, mb)
    for a, b, t in zip(src.tolist(), dst.tolist(), lat.tolist()):
        graph.add_edge(ops[a], ops[b], latency=t)
    for s in sorted({op.stage for op in ops}):  # workers' stages (compute ops decode to
        graph.add_node((SYNC, s), duration=0.0, worker=None)  # virtual stages)
    for op in ops:
        if op.kind in ("W", "B"):  # a stage's all-reduce needs every weight gradient of it
            graph.add_edge(op, (SYNC, op.stage), latency=0.0)
    for order in schedule.orders:
        named = space.to_ops(order)
        for i, op in enumerate(named):
            if op.kind == "ALLREDUCE":
                # A stage's all-reduce starts on all its workers when the last one is ready.
                sync = (SYNC, op.stage)
                graph.add_edge(sync, op, latency=0.0)
                if with_order and i > 0:
                    graph.add_edge(named[i - 1], sync, latency=0.0)
            elif with_order and i > 0 and not graph.has_edge(named[i - 1], op):
                # (a data edge between the two keeps its latency: a worker that holds two
                # consecutive virtual stages still sends itself the activation)
                graph.add_edge(named[i - 1], op, latency=0.0)
    return graph


def plan_graph(schedule: Schedule) -> nx.DiGraph:
    """Data dependencies plus every worker's order."""
    return _nodes_and_edges(schedule, with_order=True)


def earliest_times(graph: nx.DiGraph) -> dict:
    """Earliest start of every node (longest path from a source); raises NetworkXUnfeasible on
    a cycle, which for a plan graph is a deadlock."""
    start: dict = {}
    for node in nx.topological_sort(graph):
        t = 0.0
        for pred, _, data in graph.in_edges(node, data=True):
            t = max(t, start[pred] + graph.nodes[pred]["duration"] + data["latency"])
        start[node] = t
    return start


def critical_path(graph: nx.DiGraph) -> list[tuple[Op, tuple[int, int], float, float]]:
    """The chain of ops that decides the iteration time: (op, worker, start, end), first to
    last."""
    start = earliest_times(graph)
    end = {n: start[n] + graph.nodes[n]["duration"] for n in graph}
    node = max(end, key=lambda n: (end[n], str(n)))
    chain = []
    while True:
        if graph.nodes[node]["worker"] is not None:
            chain.append((node, graph.nodes[node]["worker"], start[node], end[node]))
        best = None
        for pred, _, data in graph.in_edges(node, data=True):
            if abs(end[pred] + data["latency"] - start[node]) <= 1e-9 * max(1.0, start[node]):
                if best is None or str(pred) < str(best):
                    best = pred
        if best is None:
            break
        node = best
    return chain[::-1]



def describe_critical_path(chain: list[tuple[Op, tuple[int, int], float, float]]) -> str:
    """One paragraph per run of the critical path on one worker, its ops in their text form
    (`Op.parse` reads them back; an op whose pipeline is not its worker's is re-routed)."""
    runs: list[list] = []
    for op, worker, a, b in chain:
        if runs and runs[-1][0] == worker:
            runs[-1][1].append(str(op))
            runs[-1][3] = b
        else:
            runs.append([worker, [str(op)], a, b])
    lines = []
    for w, ops, a, b in runs:
        line = f"  {a:>8.4g} - {b:<8.4g} worker {w[0]}:{w[1]} "
        indent = " " * len(line)
        for i, text in enumerate(ops):
            if i and len(line) + 1 + len(text) > 100:  # wrap between ops, never inside one
                lines.append(line)
                line = indent
            line += " " + text
        lines.append(line)
    return "\n".join(lines)
