"""Planning a pipeline: per-layer profiles, balancing, the cost model and
its simulator, the planner, and `auto` (what the runtime asks of it)."""
