"""The searches: the exact per-layer search of dense models (`dense`), the 3D search over
pipelines (`pipeline`) with its stage partitioner (`stage_partition`) and the SPMD pipelines'
closed-form stages (`spmd_stages`), and MoE models' (`moe`)."""
