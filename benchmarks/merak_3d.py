"""The 3D search beside Megatron-LM's plan (uniform stages, 1F1B, full recompute) for Merak's four
GPT models on v100-64 and h100-64, global batch 128 x 1024, bf16, with search times.
`JAX_PLATFORMS=cpu .venv/bin/python benchmarks/merak_3d.py`
(benchmarks/results/plan_3d_vs_megatron_merak_models.txt)."""

import time

from oases_jax.hardware import get_cluster
from oases_jax.models import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.search.pipeline import megatron_3d, search_3d


def main() -> None:
    for cluster in ("v100-64", "h100-64"):
        hw = Hardware.of(get_cluster(cluster))
        for name in ("gpt2-1.5b", "gpt-2.5b", "gpt-8.3b", "gpt-20b"):
            cfg = get_preset(name).replace(dtype="bfloat16")
            t0 = time.perf_counter()
            ours = search_3d(cfg, hw, global_batch=128, seq_len=1024)
            t1 = time.perf_counter()
            meg = megatron_3d(cfg, hw, global_batch=128, seq_len=1024)
            t2 = time.perf_counter()
            print(cluster, name, cfg.dtype, f"search {t1 - t0:.2f}s meg {t2 - t1:.2f}s")
            for label, best in (("ours", ours[0] if ours else None),
                                ("meg ", meg[0] if meg else None)):
                print("  ", label, best.summary() if best else None,
                      f"{best.step_s * 1e3:.1f} ms" if best else "")
            if ours and meg:
                print("   speedup", round(meg[0].step_s / ours[0].step_s, 3))


if __name__ == "__main__":
    main()
