"""recycle-planner: keep hybrid-parallel training at full speed when workers fail, by
re-routing a dead worker's micro-batches to its data-parallel peers (ReCycle, SOSP 2024)."""

__version__ = "0.1.0"
