"""The overlap table of docs/parallelism.md: the overlapped schedules against megatron and
megatron_sp on the programs a GPU runs (bf16, the attention kernel the model picks), compiled
deviceless through the one compile path, with both opinions (this project's simulator and XLA's
estimate), the share of the step that is exposed communication and each collective's covered
share in program order.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/overlap_table.py [ROW...] > OUT.txt

ROWs (default: the one-layer rows, about 3 minutes on 2 cores): gpt2-layer-t8, gpt2-layer-t4,
gpt2-step-d2t4, llama-layer-t8, llama-step-l8-t8. `--list` prints them.
"""

import sys

from oases_jax import provenance
from oases_jax.models import get_preset
from oases_jax.targets import get_target
from oases_jax.tools.inspection import inspect_program
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec

SCHEDULES = ("megatron", "megatron_sp", "oases", "oases_sp")
OVERLAPPED = ("oases", "oases_sp")
GPT2_MAT = {"dtype": "bfloat16", "n_heads": 32, "head_dim": 50}  # materialised attention
GPT2 = {"dtype": "bfloat16", "n_heads": 20, "head_dim": 80}  # cuDNN's flash attention
LLAMA = {"dtype": "bfloat16"}
# name: (what, preset, overrides, target, mesh, batch, seq, layer)
ROWS = {
    "gpt2-layer-t8": ("one GPT-2 1.5B layer, 32 heads of 50", "gpt2-1.5b", GPT2_MAT, "h100:8",
                      "tensor=8", 8, 1024, True),
    "gpt2-layer-t4": ("one GPT-2 1.5B layer, 20 heads of 80", "gpt2-1.5b", GPT2, "h100:4",
                      "tensor=4", 8, 1024, True),
    "gpt2-step-d2t4": ("GPT-2 1.5B train step, 20 heads of 80", "gpt2-1.5b", GPT2, "h100:8",
                       "data=2,tensor=4", 8, 1024, False),
    "llama-layer-t8": ("one Llama-2 7B layer", "llama2-7b", LLAMA, "h100:8", "tensor=8", 8,
                       2048, True),
    "llama-step-l8-t8": ("Llama-2 7B train step, 8 layers", "llama2-7b", {**LLAMA, "n_layers": 8},
                         "h100:8", "tensor=8", 8, 2048, False),
}
DEFAULT_ROWS = ("gpt2-layer-t8", "gpt2-layer-t4")


def measure(name: str) -> list[dict]:
    what, preset, overrides, target, mesh, batch, seq, layer = ROWS[name]
    model = get_preset(preset).replace(**overrides)
    out = []
    for schedule in SCHEDULES:
        spec = CompileSpec(model=model, batch_size=batch, seq_len=seq, layer=layer,
                           parallel=ParallelConfig(mesh=mesh, schedule=schedule))
        r = inspect_program(spec, get_target(target)).report()
        xla = r.get("xla_estimate") or {}
        shares = [c["share"] for c in r["hidden"]["collectives"] if c["end_s"] > c["start_s"]]
        out.append({"row": name, "what": what, "target": target, "mesh": mesh,
                    "batch": f"{batch} x {seq}", "schedule": schedule,
                    "sim_s": r["simulated_step_s"], "compute_s": r["compute_s"],
                    "exposed_share": r["hidden"]["exposed_share"],
                    "hidden_share": r["hidden"]["hidden_share"], "xla_s": xla.get("step_s"),
                    "attention": r["attention_kernel"], "shares": shares})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| program | target, mesh | schedule | sim step (ratio) | XLA step (ratio) | "
             "compute | exposed share | covered share | collectives covered, in order |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = [b for b in rows if b["row"] == r["row"]]
        plain = [b for b in base if b["schedule"] not in OVERLAPPED]
        ratio = r["sim_s"] / min(b["sim_s"] for b in plain)
        best_xla = min((b["xla_s"] for b in plain if b["xla_s"]), default=None)
        xla = (f"{r['xla_s'] * 1e3:.2f} ms ({r['xla_s'] / best_xla:.2f})"
               if r["xla_s"] and best_xla else "-")
        shares = " ".join(f"{s:.2f}" for s in r["shares"][:12])
        shares += " ..." if len(r["shares"]) > 12 else ""
        lines.append(f"| {r['what']}, batch {r['batch']}, {r['attention']} | {r['target']}, "
                     f"{r['mesh']} | {r['schedule']} | {r['sim_s'] * 1e3:.3f} ms ({ratio:.2f}) "
                     f"| {xla} | {r['compute_s'] * 1e3:.3f} ms | {r['exposed_share']:.1%} | "
                     f"{r['hidden_share']:.1%} | {shares} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--list" in argv:
        print("\n".join(f"{k}: {v[0]} on {v[3]}, {v[4]}" for k, v in ROWS.items()))
        return 0
    names = argv or list(DEFAULT_ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"overlap_table.py: unknown row {unknown[0]!r}: choose from {', '.join(ROWS)}",
              file=sys.stderr)
        return 2
    rows = [r for n in names for r in measure(n)]
    print(provenance.header() + "\n")
    print("Ratios to the better of megatron and megatron_sp under the same opinion; exposed "
          "share: the step's communication nothing covers; covered share: of the collectives' "
          "simulated time, what compute on the other stream covers.\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
