"""Test-only views of the dependency DAG: the job's data dependencies without worker orders,
and the longest path of a graph (the iteration time a plan graph implies)."""

import networkx as nx

from recycle_planner.schedules.schedule import Schedule
from recycle_planner.timing.dag import _nodes_and_edges, earliest_times


def job_graph(schedule: Schedule) -> nx.DiGraph:
    """Data dependencies only, for the ops this schedule places."""
    return _nodes_and_edges(schedule, with_order=False)


def longest_path_length(graph: nx.DiGraph) -> float:
    start = earliest_times(graph)
    return max((start[n] + graph.nodes[n]["duration"] for n in graph), default=0.0)

