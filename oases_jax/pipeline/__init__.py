"""Pipeline parallelism, its pure-Python layer: one record per schedule (`registry`), the
schedules as plain data (`schedules`, `table`), their validator (`validate`) and event simulator
(`events`), Merak's stage-aware recomputation ratios (`remat`), and the tick executor
(`executor`, `lowering`, `pools`, `fuse`)."""
