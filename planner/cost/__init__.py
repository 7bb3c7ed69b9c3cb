"""The cost model: single-op prices (`prices`), one layer's work and its two-stream replay
(`layer_work`, `layer_cost`, `primepar_cost`, FSDP's gathers `fsdp_chain`), the one step model
(`step_cost`), MoE layers and steps (`moe_cost`, `moe_step`), and pipeline stages under a
schedule (`stage_sim`, FSDP inside them `stage_fsdp`)."""
