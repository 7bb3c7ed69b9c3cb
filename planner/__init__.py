"""The parallel-plan planner (cost model and search); filled by the planner work."""
