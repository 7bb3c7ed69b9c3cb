"""Pipeline parallelism, its pure-Python layer: schedules as plain data (`schedules`, `table`),
their validator (`validate`) and event simulator (`events`), and Merak's stage-aware
recomputation ratios (`remat`)."""

# The tensor-parallel schedules a pipeline stage runs (checked equal to the unpipelined model).
# The others move data with collective-permutes inside the tick's switch, where devices of
# different stages take different branches: on the CPU runtime that deadlocks the collective
# rendezvous (megatron_sp measured), so they are refused until each is tested.
STAGE_SCHEDULES = ("megatron", "oases")
