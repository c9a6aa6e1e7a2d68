"""Timing and checks: the simulator that times a schedule, the rules every plan must keep, the
dependency DAG for critical paths, and the plan (a timed schedule with its typed metrics)."""
