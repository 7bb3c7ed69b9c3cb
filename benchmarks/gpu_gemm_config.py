"""The GEMM kernels XLA's GPU compiler picks for the chunked GEMMs of collective-matmul rings, with
and without a GPU to autotune on, and what each costs on the GPU.

A deviceless compile has no GPU to autotune on, and it rewrites the rings' 512-row chunks into
split-K Triton fusions (bf16 in, float32 partials out, then a reduction), which our simulator prices
at 1.7x the chunks' roofline (docs/planner.md, "What the planner still gets wrong"). This script
compiles each chunk's GEMM and its two backward GEMMs alone and reports the kernel chosen (cuBLAS,
or Triton with its tiles and split-K) and, on a GPU, the measured time per call beside the roofline:

  python benchmarks/gpu_gemm_config.py --out gemm_config.json                 (on a GPU)
  XLA_FLAGS=--xla_gpu_autotune_level=0 python benchmarks/gpu_gemm_config.py   (no autotuning)
  python benchmarks/gpu_gemm_config.py --target h100:1 --out deviceless.json  (no GPU: kernels only)
  python benchmarks/gpu_gemm_config.py --table A.json B.json ...              (side by side)

Each timed program runs REPEATS independent GEMMs back to back (different operands, so none is
hoisted); the time per call is the program's median over rounds divided by REPEATS. The host's
dispatch of such a program sets a floor under it (about 35 us a call on one H200 with jax 0.11.2:
GEMMs of 2 and 8 GFLOP timed alike), so the same program of 16 x 16 x 16 GEMMs is timed first and
its time per call kept as `floor_us`: times near it measure the host, not the kernel. The chunked
GEMMs' own times come from `scripts/calibrate.py --tensor 4`, which chains calls until a program
runs 5 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

# (name, rows, k, n) of one ring step's forward GEMM per device at tensor=4; the backward's are
# derived: dX = dY W^T (rows, n, k) and dW = X^T dY (k, rows, n).
SHAPES = {
    "gpt2-1.5b/t4": [("qkv", 1600, 1200), ("proj", 400, 1600), ("fc1", 1600, 1600),
                     ("fc2", 1600, 1600)],
    "llama2-7b/t4": [("qkv", 4096, 3072), ("proj", 1024, 4096), ("gate_up", 4096, 5504),
                     ("down", 2752, 4096)],
}
PEAK_BF16 = {"h100": 989e12, "h200": 989e12}
HBM = {"h100": 3.35e12, "h200": 4.8e12}


def kernels(hlo: str) -> list[dict]:
    """The GEMM kernels of an optimised HLO module's entry: for each cuBLAS call or Triton GEMM
    fusion, its output type (a split-K GEMM's has the split as a leading dimension, summed by a
    reduction fusion after it), its kind and its tile configuration as XLA wrote it."""
    out = []
    entry = hlo[hlo.rfind("\nENTRY"):]
    for line in entry.splitlines():
        kind = re.search(r'"kind":"(__triton[a-z_]*|__cublas[^"]*)"', line) or \
            re.search(r'custom_call_target="(__cublas[^"]*)"', line)
        if not kind:
            continue
        shape = re.search(r"= (\w+\[[\d,]*\])", line)
        config = re.search(r'"(block_level_fusion_config|triton_gemm_config)":(\{.*?\})[,}]', line)
        out.append({"kind": kind.group(1), "out": shape.group(1) if shape else "?",
                    "config": config.group(2) if config else ""})
    return out


def program(repeats: int):
    def f(xs, ws):
        return [jnp.dot(xs[i], ws[i]) for i in range(repeats)]
    return jax.jit(f)


def timed(fn, a: int, b: int, c: int, args) -> float:
    """Median microseconds of one run of `fn` on random [REPEATS, a, b] x [REPEATS, b, c]."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.repeats, a, b), jnp.bfloat16)
    w = jax.random.normal(kw, (args.repeats, b, c), jnp.bfloat16)
    jax.block_until_ready(fn(x, w))
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        jax.block_until_ready(fn(x, w))
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def table(paths: list[str]) -> str:
    """Each GEMM's kernel output (a split-K GEMM's with the split leading) and time per call in
    each file, one column per file."""
    runs = [json.load(open(path)) for path in paths]
    rows = {}
    for i, run in enumerate(runs):
        for r in run["results"]:
            key = (r["model"], r["rows"], r["gemm"], r["role"], r["m"], r["k"], r["n"])
            out = r["kernels"][0]["out"] if r["kernels"] else "-"
            us = f" {r['us_per_call']:.1f}us" if "us_per_call" in r else ""
            rows.setdefault(key, ["(not run)"] * len(runs))[i] = f"{out}{us}"
    head = [(f"{m['gpu']} {'GPU' if m['target'] == 'local' else 'deviceless'} jax {m['jax']} "
             f"{m['xla_flags']}").strip() for m in (run["meta"] for run in runs)]
    lines = ["model/gemm/role  m x k x n  | " + " | ".join(head)]
    lines += [f"{k[0]} {k[2]} {k[3]}  {k[4]}x{k[5]}x{k[6]} | " + " | ".join(v)
              for k, v in rows.items()]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="local", help="local (a GPU) or h100:1 (deviceless)")
    p.add_argument("--rows", default="512,2048", help="rows of a ring chunk (default 512,2048)")
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--table", nargs="+", metavar="JSON", help="print these runs side by side")
    args = p.parse_args()
    if args.table:
        try:
            print(table(args.table))
        except (OSError, ValueError, KeyError) as e:
            p.exit(2, f"gpu_gemm_config.py: cannot read --table files: {e}; pass JSONs this "
                      "script wrote with --out\n")
        return 0
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.exit(2, f"gpu_gemm_config.py: --rows {args.rows!r} is not a list like 512,2048\n")
    if min(rows + [args.repeats, args.rounds]) < 1:
        p.exit(2, "gpu_gemm_config.py: --rows, --repeats and --rounds must be positive\n")
    gpu = args.target.split(":")[0] if args.target != "local" else \
        jax.devices()[0].device_kind.split()[-1].lower()
    if args.target != "local":
        from oases_jax.targets import get_target
        device = get_target(args.target).devices[0]
    else:
        device = jax.devices()[0]
    rows_list = rows
    meta = {"target": args.target, "gpu": gpu, "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv}
    results = []
    if args.target == "local":
        meta["floor_us"] = timed(program(args.repeats), 16, 16, 16, args) \
            / args.repeats
    for model, shapes in SHAPES.items():
        for rows in rows_list:
            for name, k, n in shapes:
                for role, (a, b, c) in (("fwd", (rows, k, n)), ("dx", (rows, n, k)),
                                        ("dw", (k, rows, n))):
                    r = args.repeats
                    xs = jax.ShapeDtypeStruct((r, a, b), jnp.bfloat16)
                    ws = jax.ShapeDtypeStruct((r, b, c), jnp.bfloat16)
                    t0 = time.perf_counter()
                    if args.target != "local":
                        shard = jax.sharding.SingleDeviceSharding(device)
                        xs = jax.ShapeDtypeStruct(xs.shape, xs.dtype, sharding=shard)
                        ws = jax.ShapeDtypeStruct(ws.shape, ws.dtype, sharding=shard)
                    compiled = program(r).lower(xs, ws).compile()
                    ks = kernels(compiled.as_text())
                    row = {"model": model, "rows": rows, "gemm": name, "role": role,
                           "m": a, "k": b, "n": c, "kernels": ks[: max(1, len(ks) // r)],
                           "reductions": compiled.as_text().count("reduce(") // r,
                           "compile_s": round(time.perf_counter() - t0, 2)}
                    flops, nbytes = 2 * a * b * c, 2 * (a * b + b * c + a * c)
                    row["roofline_us"] = 1e6 * max(flops / PEAK_BF16.get(gpu, 989e12),
                                                   nbytes / HBM.get(gpu, 3.35e12))
                    if args.target == "local":
                        row["us_per_call"] = timed(compiled, a, b, c, args) / r
                        row["tflops"] = flops / (row["us_per_call"] * 1e-6) / 1e12
                        row["over_roofline"] = row["us_per_call"] / row["roofline_us"]
                    results.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:  # after every row: a run stopped at its time limit keeps them
                        with open(args.out + ".part", "w") as f:
                            json.dump({"meta": meta, "results": results}, f, indent=1)
                        os.replace(args.out + ".part", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
