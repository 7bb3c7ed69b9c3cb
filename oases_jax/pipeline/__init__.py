"""Pipeline parallelism, its pure-Python layer: schedules as plain data (`schedules`, `table`),
their validator (`validate`) and event simulator (`events`), and Merak's stage-aware
recomputation ratios (`remat`)."""

# The tensor-parallel schedules a pipeline stage runs (each checked equal to the unpipelined
# model). Their collectives inside the tick's switch, where devices of different stages take
# different branches, are all-reduces, all-gathers and reduce-scatters over `tensor`, whose
# rendezvous is the tensor group. A collective-permute's is every device (the CPU runtime; the
# permutes run by no other stage never complete), so the ring schedules (collective_matmul,
# oases_cm) and PrimePar's rotations are refused; megatron_sp runs since its token shift and
# position rows are taken outside the loop (`training.pipeline_layout.shifted`).
STAGE_SCHEDULES = ("megatron", "megatron_sp", "oases")
# The pipelines with no per-stage control flow (`training.pipeline_spmd`): every device runs the
# same program every tick, so any tensor-parallel schedule runs inside their stages, the rings
# included; one program means equal stages under the model's --remat.
SPMD_PIPELINES = ("gpipe_spmd", "1f1b_spmd")
