"""cuDNN flash attention against the materialised (xla) attention on a real GPU: the same
parameters and batch, loss and every gradient under both kernels, bf16 compute.
`python benchmarks/gpu_attention_check.py [--model small]` on a GPU machine (no test can run
this: cuDNN's kernel needs a GPU)."""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--model-set", action="append", default=[])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from oases_jax.models import Transformer, cross_entropy, get_preset

    base = get_preset(args.model).with_overrides(args.model_set).replace(dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (args.batch_size, args.seq_len + 1), 0,
                                base.vocab_size)
    results = {}
    for impl in ("xla", "cudnn", "fp32"):
        cfg = base.replace(attention="xla", dtype="float32") if impl == "fp32" else \
            base.replace(attention=impl)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

        def loss(p, cfg=cfg, graphdef=graphdef):
            return cross_entropy(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:],
                                 cfg.vocab_size)

        fn = jax.jit(jax.value_and_grad(loss))
        compiled = fn.lower(params).compile()  # one compile: run what was inspected
        value, grads = compiled(params)
        used_cudnn = "cudnn" in compiled.as_text().lower()
        results[impl] = (float(value), jax.tree.leaves(grads), used_cudnn)
    ref_loss, ref_grads, _ = results["fp32"]

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))

    print(f"{args.model}, batch {args.batch_size} x {args.seq_len}, "
          f"{jax.devices()[0].device_kind}; cuDNN custom call in the cudnn program: "
          f"{results['cudnn'][2]}")
    print(f"loss: fp32 reference {ref_loss:.6f}")
    for impl in ("xla", "cudnn"):
        value, grads, _ = results[impl]
        r = [rel(a, b) for a, b in zip(grads, ref_grads, strict=True)]
        gap = abs(value - ref_loss) / ref_loss
        print(f"  bf16 {impl:<5} loss {value:.6f} (relative {gap:.2e}); "
              f"gradients vs fp32: relative L2 median {np.median(r):.2e}, max {max(r):.2e}")
    r = [rel(a, b) for a, b in zip(results["cudnn"][1], results["xla"][1], strict=True)]
    print(f"  cudnn vs xla (both bf16): loss {abs(results['cudnn'][0] - results['xla'][0]):.2e} "
          f"apart; gradients relative L2 median {np.median(r):.2e}, max {max(r):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
