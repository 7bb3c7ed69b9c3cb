"""Where a train step's GPU time goes: trace a few steps of one bench variant with the JAX
profiler and sum the device kernels by name (and by kind: GEMM, fusion, copy, other).
`python benchmarks/gpu_kernels.py --model gpt2-1.5b --dtype bfloat16 --remat full --variant
data=1/tp/megatron --batch-size 8 --seq-len 1024` on a GPU machine."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scripts.bench import build_config, parse_args  # noqa: E402


def kind_of(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "cublas", "cutlass", "sm90_xmma", "nvjet", "triton_gemm")):
        return "gemm"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    if "fusion" in n or "reduce" in n or "loop_" in n or "input_" in n:
        return "fusion"
    return "other"


def device_events(trace_dir: str) -> list[dict]:
    (path,) = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "gpu" in n.lower() or "device" in n.lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]


def main() -> int:
    args = parse_args()
    import jax

    from tools.bench import prepare, warm_up

    cfg = build_config(args)
    (variant,) = prepare(cfg, lambda m: print(m, file=sys.stderr))[:1]
    warm_up([variant], 2)
    steps = 3
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                variant.run_step()
        events = device_events(d)
    by_name, by_kind = collections.Counter(), collections.Counter()
    for e in events:
        by_name[e["name"]] += e["dur"]
        by_kind[kind_of(e["name"])] += e["dur"]
    total = sum(by_kind.values())
    print(f"{variant.spec.label}: {steps} steps, device kernel time {total / steps / 1e3:.2f} ms "
          "per step")
    for k, us in by_kind.most_common():
        print(f"  {k:<8} {us / steps / 1e3:9.2f} ms  {us / total:6.1%}")
    print("top kernels (ms per step):")
    for name, us in by_name.most_common(30):
        print(f"  {us / steps / 1e3:9.3f}  {kind_of(name):<6}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
