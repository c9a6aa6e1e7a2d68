"""The job model, where the flow starts: the job spec (TOML, or measured by the profiler), the
policy (which mechanisms a plan may use), the dead workers, and failure situations with their
physical -> logical mappings."""
