"""Pipeline parallelism, its pure-Python layer: schedules as plain data (`schedules`, `table`),
their validator (`validate`) and event simulator (`events`), and Merak's stage-aware
recomputation ratios (`remat`)."""
