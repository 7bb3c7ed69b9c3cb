"""Predictions checked against programs: plans compiled through the one compile path and
simulated (`verify`, `verify_pipeline`, MoE layers `moe_compiled`), and the planner's ranking of
measured plans (`rank`). These import the compile path: import them on use."""
