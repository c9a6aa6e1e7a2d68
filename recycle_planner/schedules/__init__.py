"""Ops and schedules without times: ops as small values and integer ids, a schedule as every
worker's ordered op list, and the fault-free generators (GPipe, 1F1B, ZB-H1). The solvers
(`recycle_planner.solvers`) turn a failure situation into such a schedule."""
