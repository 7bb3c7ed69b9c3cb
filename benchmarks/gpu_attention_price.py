"""On one GPU: cuDNN's fused attention timed at one shape, beside the price this project's analysis
gives the same compiled calls (`oases_jax.tools.analysis.attention`, `simulate.roofline_time`).
`python benchmarks/gpu_attention_price.py --batch 4 --seq 2048 --heads 8 --head-dim 128`"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from oases_jax.hardware import detect
from oases_jax.tools.analysis.attention import fused_attention_flops, is_backward
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.analysis.simulate import roofline_time


def _median_s(f, *args, calls: int = 50, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back asynchronous calls."""
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    shape = (args.batch, args.seq, args.heads, args.head_dim)  # BTNH
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    fwd, both = jax.jit(attn), jax.jit(fwd_bwd)
    device = jax.devices()[0]
    spec = detect(device.device_kind)
    text = both.lower(q, k, v, do).compile().as_text()
    program = Program(text)
    priced = {}
    for comp, instr, _ in program.fused_attention_calls():
        name = "backward" if is_backward(instr) else "forward"
        # the last output, u8[N], is cuDNN's workspace: N is 0 in a deviceless compile
        workspace = next((a.bytes for a in instr.shapes[::-1] if a.dtype == "u8"), 0)
        priced[name] = {"flops": fused_attention_flops(instr, comp),
                        "roofline_s": roofline_time(program, comp, instr, spec),
                        "workspace_bytes": workspace}
    t_fwd, t_both = _median_s(fwd, q, k, v), _median_s(both, q, k, v, do)
    measured = {"forward": t_fwd, "backward": t_both - t_fwd}
    print(f"{device.device_kind}, jax {jax.__version__}: causal cuDNN attention, B={args.batch} "
          f"L={args.seq} H={args.heads} K={args.head_dim}, bf16")
    for name in ("forward", "backward"):
        c, t = priced[name], measured[name]
        print(f"  {name:<8} {c['flops'] / 1e9:8.1f} GFLOP  measured {t * 1e6:8.1f} us "
              f"({c['flops'] / t / 1e12:6.1f} TFLOP/s)  roofline {c['roofline_s'] * 1e6:8.1f} us "
              f"(measured / roofline {t / c['roofline_s']:.2f}x)  cuDNN workspace "
              f"{c['workspace_bytes'] / 2**20:.1f} MiB")
    print(json.dumps({"shape": shape, "priced": priced, "measured_s": measured}))


if __name__ == "__main__":
    main()
