"""XLA's estimator as a cost source: single-collective programs move the bytes the samples
claim, and a small sweep yields profile samples priced by XLA (compiled for h100:8)."""

import pytest

from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis import xla_sweep
from oases_jax.tools.analysis.program import analyze

pytestmark = [pytest.mark.gpu_aot,
              pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")]
MIB = 2**20


@pytest.mark.parametrize("kind", xla_sweep.KINDS)
@pytest.mark.parametrize("n", [2, 8])
def test_each_program_moves_the_bytes_of_its_sample(kind, n):
    devices = get_target("h100:8").devices
    lowered = xla_sweep.collective_program(kind, n, 4 * MIB, devices)
    analysis, _ = analyze(lowered.compile(), _mesh_of(devices, n))
    (c,) = analysis.collectives
    assert c.kind == kind and c.bytes == 4 * MIB  # collective_time's bytes: see its docstring
    assert c.group_size == (2 if kind == "collective-permute" else n)


def _mesh_of(devices, n):
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(devices, dtype=object).reshape(-1, n), ("rest", "g"))


def test_small_sweep_gives_profile_samples_priced_by_xla():
    devices = get_target("h100:8").devices
    cfg = xla_sweep.SweepConfig(kinds=("all-gather", "collective-permute"), groups=(8,),
                                sizes=(MIB, 16 * MIB), gemm_shapes=((2048, 1024, 512),),
                                gemm_dtypes=("bfloat16",), chunks=(1, 2))
    gemm, comm = xla_sweep.sweep(devices, cfg, log=lambda s: None)
    assert [(s["kind"], s["n"], s["bytes"]) for s in comm] == [
        ("all-gather", 8, MIB), ("all-gather", 8, 16 * MIB),
        ("collective-permute", 8, MIB), ("collective-permute", 8, 16 * MIB)]
    # Bigger transfers cost more, and XLA's price is its own, not the datasheet's.
    assert comm[0]["seconds"] < comm[1]["seconds"] and comm[2]["seconds"] < comm[3]["seconds"]
    assert comm[0]["seconds"] == xla_sweep.collective_seconds("all-gather", 8, MIB, devices)
    one, two = gemm
    assert (one["chunks"], two["chunks"]) == (1, 2) and one["m"] == two["m"] == 2048
    assert two["seconds"] == pytest.approx(
        2 * xla_sweep.gemm_seconds(1024, 1024, 512, "bfloat16", devices[0]))
    profile = pytest.importorskip("oases_jax.planner.calibration.profile")
    prof = profile.Profile.from_samples(gemm, comm, source="xla", device="h100", n_devices=8)
    assert prof.covers("all-gather", 8) and prof.comm_time("all-gather", 4 * MIB, 8) > 0
