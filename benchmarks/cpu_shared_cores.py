"""How the 8 virtual CPU devices share the host's cores: 20 chained 256 x 256 GEMMs under
`lax.cond` on 8, 4, 2 and 1 of the 8 devices, median of 7 runs each. The idle devices' share of
the cores goes to the busy ones, which is what `planner.cost.prices.SharedCores` prices
(docs/planner.md, "Ranking on the CPU devices").

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/cpu_shared_cores.py

(benchmarks/results/cpu_shared_cores.txt; a few seconds here)."""

import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

P = jax.P


def work(x):
    for _ in range(20):
        x = jnp.tanh(x @ x)
    return x


def program(mesh, busy: int):
    def body(x):
        return jax.lax.cond(jax.lax.axis_index("d") < busy, work, lambda y: y, x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def main() -> None:
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.device_put(jnp.full((8 * 256, 256), 0.01), jax.NamedSharding(mesh, P("d")))
    for busy in (8, 4, 2, 1):
        f = program(mesh, busy)
        f(x).block_until_ready()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{busy} of 8 devices busy: {statistics.median(times) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
