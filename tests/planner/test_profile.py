"""Calibration profiles: the fits recover hand-chosen parameters, costs by hand arithmetic, JSON
files and their errors, the measured programs, and scripts/calibrate.py end to end."""

import json
import math

import jax
import pytest

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.planner.calibration.calibrate import (
    _collective_chain,
    _gemm_chain,
    byte_sizes,
    projection_shapes,
)
from oases_jax.planner.calibration.profile import (
    COMM_KINDS,
    ROOT,
    CommFit,
    GemmFit,
    MemFit,
    Profile,
    default_profile_path,
)
from tests.scriptrun import run_script

SHAPES = [(512, 256, 1024), (256, 256, 256), (1024, 512, 128)]


def gemm_samples(fits: dict[str, GemmFit]) -> list[dict]:
    return [{"m": m, "n": n, "k": k, "dtype": dt, "chunks": c,
             "seconds": c * f.overhead_s + 2 * m * n * k / f.flops_per_s}
            for dt, f in fits.items() for m, k, n in SHAPES for c in (1, 2, 4, 8)]


def comm_samples(fits: dict[tuple[str, int], CommFit]) -> list[dict]:
    return [{"kind": kind, "n": n, "bytes": b, "seconds": f.latency_s + b / f.bytes_per_s}
            for (kind, n), f in fits.items() for b in (2**14, 2**17, 2**20, 2**22)]


def profile(**kw) -> Profile:
    kw = {"source": "profile", "device": "cpu", "n_devices": 8, "samples": {}, "meta": {}} | kw
    return Profile(**kw)


def test_fits_recover_the_parameters_of_exact_samples():
    gemm = {"float32": GemmFit(flops_per_s=2e10, overhead_s=5e-5),
            "bfloat16": GemmFit(flops_per_s=8e10, overhead_s=0.0)}
    comm = {(kind, n): CommFit(bytes_per_s=1e9 * n, latency_s=1e-5 * (n + i))
            for i, kind in enumerate(COMM_KINDS) for n in (2, 4, 8)}
    prof = Profile.from_samples(gemm_samples(gemm), comm_samples(comm), source="profile",
                                device="cpu", n_devices=8)
    assert prof.gemm.keys() == gemm.keys() and prof.comm.keys() == comm.keys()
    for dt, f in gemm.items():
        assert prof.gemm[dt].flops_per_s == pytest.approx(f.flops_per_s, rel=1e-9)
        assert prof.gemm[dt].overhead_s == pytest.approx(f.overhead_s, rel=1e-9, abs=1e-15)
    for key, f in comm.items():
        assert prof.comm[key].bytes_per_s == pytest.approx(f.bytes_per_s, rel=1e-9)
        assert prof.comm[key].latency_s == pytest.approx(f.latency_s, rel=1e-9)
    assert prof.samples["gemm"] == gemm_samples(gemm) and prof.meta == {}


def test_fit_parameters_are_never_negative():
    # Times that grow faster than the bytes: the unconstrained line has a negative latency. The
    # fit is then bytes / bw alone, minimising sum((x/bw - t) / t)^2: 1/bw = sum(r) / sum(r^2)
    # with r = x / t. Here r = 1, 1/2, 1/4 -> 1/bw = 1.75 / 1.3125 = 4/3.
    samples = [{"kind": "all-reduce", "n": 2, "bytes": b, "seconds": t}
               for b, t in ((1, 1), (2, 4), (4, 16))]
    fit = Profile.from_samples([], samples, source="profile", device="cpu", n_devices=2).comm[
        ("all-reduce", 2)]
    assert fit.latency_s == 0 and fit.bytes_per_s == pytest.approx(3 / 4, rel=1e-12)
    # Times that fall with size: no bandwidth term; latency = sum(1/t) / sum(1/t^2).
    samples = [{"kind": "all-gather", "n": 4, "bytes": b, "seconds": t}
               for b, t in ((1, 2.0), (2, 1.0))]
    fit = Profile.from_samples([], samples, source="profile", device="cpu", n_devices=4).comm[
        ("all-gather", 4)]
    assert fit.bytes_per_s == math.inf and fit.latency_s == pytest.approx(1.5 / 1.25, rel=1e-12)


def test_from_samples_rejects_what_it_cannot_fit():
    one_size = [{"kind": "all-reduce", "n": 2, "bytes": 1024, "seconds": 1e-4}] * 3
    with pytest.raises(UserError, match="at least two sizes"):
        Profile.from_samples([], one_size, source="profile", device="cpu", n_devices=2)
    with pytest.raises(UserError, match="'broadcast' is unknown"):
        Profile.from_samples([], [{"kind": "broadcast", "n": 2, "bytes": 1, "seconds": 1}],
                             source="profile", device="cpu", n_devices=2)
    with pytest.raises(UserError, match="lacks a numeric 'seconds'"):
        Profile.from_samples([{"m": 1, "n": 1, "k": 1, "dtype": "float32", "chunks": 1}], [],
                             source="profile", device="cpu", n_devices=2)
    with pytest.raises(UserError, match="source 'guess' is unknown"):
        Profile.from_samples([], [], source="guess", device="cpu", n_devices=2)


def test_costs_by_hand_arithmetic():
    prof = profile(gemm={"bfloat16": GemmFit(flops_per_s=1e12, overhead_s=1e-5)},
                   comm={("all-reduce", 4): CommFit(bytes_per_s=1e9, latency_s=2e-5),
                         ("all-gather", 4): CommFit(bytes_per_s=math.inf, latency_s=3e-5),
                         ("all-reduce", 2): CommFit(bytes_per_s=2e9, latency_s=1e-5)})
    # 4 calls of 0.5 GFLOP: 4 * 10 us + 2 GFLOP / 1 TFLOP/s = 40 us + 2 ms.
    assert prof.gemm_time(2e9, "bfloat16", chunks=4) == pytest.approx(2.04e-3, rel=1e-12)
    assert prof.gemm_time(2e9, "bfloat16") == pytest.approx(2.01e-3, rel=1e-12)
    assert prof.gemm_time(2e9, "float32") is None
    # 20 us + 1 MB / 1 GB/s = 1.02 ms; no bandwidth term: the latency alone.
    assert prof.comm_time("all-reduce", 1e6, 4) == pytest.approx(1.02e-3, rel=1e-12)
    assert prof.comm_time("all-gather", 1e6, 4) == pytest.approx(3e-5, rel=1e-12)
    assert prof.comm_time("all-reduce", 1e6, 8) is None
    assert prof.comm_time("all-to-all", 1e6, 4) is None
    assert prof.comm_time("all-reduce", 1e6, 1) == 0.0 == prof.comm_time("all-reduce", 0, 8)
    assert prof.covers("all-reduce", 2) and not prof.covers("all-reduce", 8)
    assert prof.coverage() == {"all-gather": [4], "all-reduce": [2, 4]}


def test_memory_fit_and_its_price_by_hand():
    # Passes of 1 MB and 4 MB taking 50 us + bytes / 2 GB/s: 0.55 ms and 2.05 ms.
    samples = [{"bytes": 1e6, "seconds": 5.5e-4}, {"bytes": 4e6, "seconds": 2.05e-3}]
    prof = Profile.from_samples(gemm_samples({"float32": GemmFit(2e10, 0.0)}), [],
                                source="profile", device="cpu", n_devices=8,
                                memory_samples=samples)
    assert prof.memory.bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert prof.memory.overhead_s == pytest.approx(5e-5, rel=1e-9)
    # The cost model lumps passes, so it charges bytes / bandwidth: 10 MB -> 5 ms.
    assert prof.mem_time(1e7) == pytest.approx(5e-3, rel=1e-9)
    assert profile(gemm={}, comm={}).mem_time(1e7) is None
    data = json.loads(json.dumps(prof.to_json(), allow_nan=False))
    assert Profile.from_json(data) == prof and data["samples"]["memory"] == samples
    with pytest.raises(UserError, match="memory pass times do not grow"):
        Profile.from_samples([], [], source="profile", device="cpu", n_devices=8,
                             memory_samples=[{"bytes": 1e6, "seconds": 2e-3},
                                             {"bytes": 4e6, "seconds": 1e-3}])


def test_json_round_trip_and_atomic_save(tmp_path):
    comm = {("all-reduce", 2): CommFit(1e9, 1e-5), ("collective-permute", 8): CommFit(math.inf, 0)}
    prof = profile(gemm={"float32": GemmFit(2e10, 5e-5)}, comm=comm,
                   samples={"gemm": [], "comm": [{"kind": "all-reduce", "n": 2, "bytes": 1,
                                                   "seconds": 1.0}]},
                   meta={"command": "python scripts/calibrate.py"})
    data = json.loads(json.dumps(prof.to_json(), allow_nan=False))  # inf is stored as null
    assert Profile.from_json(data) == prof
    path = tmp_path / "sub" / "cpu-8.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert [p.name for p in path.parent.iterdir()] == ["cpu-8.json"]


def test_load_errors_are_one_line_with_the_fix(tmp_path):
    def error(path) -> str:
        with pytest.raises(UserError) as e:
            Profile.load(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
        return str(e.value)

    assert "does not exist; make it with `python scripts/calibrate.py" in error(
        tmp_path / "no.json")
    (bad := tmp_path / "bad.json").write_text('{"format": "oases-jax-pro')
    assert "is not valid JSON" in error(bad)
    (other := tmp_path / "cluster.json").write_text(json.dumps({"name": "c", "levels": []}))
    assert "not a calibration profile" in error(other)
    good = profile(gemm={}, comm={}).to_json()
    (old := tmp_path / "old.json").write_text(json.dumps(good | {"version": 0}))
    assert "version = 0: this version reads version 1 only" in error(old)
    (broken := tmp_path / "broken.json").write_text(json.dumps(good | {"comm": [{"n": 2}]}))
    assert "comm[0].kind is missing" in error(broken)
    (neg := tmp_path / "neg.json").write_text(json.dumps(
        good | {"gemm": {"float32": {"flops_per_s": -1, "overhead_s": 0}}}))
    assert "gemm.float32.flops_per_s = -1: must be > 0" in error(neg)


def test_default_path_and_measurement_sizes():
    assert default_profile_path("cpu", 8) == ROOT / "planner" / "profiles" / "cpu-8.json"
    assert byte_sizes(16384, 65536) == (16384, 32768, 65536)
    assert byte_sizes(1000, 3000) == (1000, 2000, 3000)
    from oases_jax.models.presets import get_preset

    # small: Q/K/V and output 256x256, MLP 256x1024 and 1024x256.
    assert projection_shapes(get_preset("small"), 512) == [
        (512, 256, 256), (512, 256, 1024), (512, 1024, 256)]
    # One device of tensor=4: Q/K/V and MLP-in columns / 4, output and MLP-out rows / 4.
    # Q/K/V 256 -> 64 columns; output 64 rows; MLP in 1024 -> 256 columns; MLP out 256 rows.
    assert projection_shapes(get_preset("small"), 512, tensor=4) == [
        (512, 256, 64), (512, 64, 256), (512, 256, 256)]
    with pytest.raises(UserError, match="--tensor 3 does not divide"):
        projection_shapes(get_preset("small"), 512, tensor=3)


def test_measured_programs_run_every_call_in_a_chain():
    """XLA merges identical GEMMs or collectives and drops unused ones; the chains must keep
    calls x chunks GEMMs and calls collectives."""
    mesh = make_mesh("data=4,tensor=2")
    P = jax.P

    def compiled(body, in_specs, *shapes):
        args = [jax.ShapeDtypeStruct(s, "float32") for s in shapes]
        f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(("data", "tensor")))
        return jax.jit(f).lower(*args).compile().as_text()

    text = compiled(_gemm_chain(4, 3), (P(("data", "tensor")), P()), (8 * 64, 32), (32, 16))
    assert text.count(" dot(") == 12
    for kind in COMM_KINDS:
        text = compiled(_collective_chain(kind, 2, "tensor", 3), P(("data", "tensor")), (8 * 64,))
        assert text.count(f" {kind}(") + text.count(f" {kind}-start(") == 3, kind


@pytest.mark.slow
def test_profile_script_quick_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "cpu-8.json"
    r = run_script("calibrate.py", "--quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    prof = Profile.load(out)
    assert (prof.source, prof.device, prof.n_devices) == ("profile", "cpu", 8)
    assert prof.coverage() == {kind: [2, 4, 8] for kind in COMM_KINDS}
    assert set(prof.gemm) == {"float32"}
    assert {s["chunks"] for s in prof.samples["gemm"]} == {1, 2, 4, 8}
    assert prof.meta["command"].startswith("python ") and "--quick" in prof.meta["command"]
    assert "collectives: time = latency + bytes / bandwidth" in r.stdout
    assert "efficiency vs 1" in r.stdout
    assert prof.memory is not None and "memory passes (fused norm" in r.stdout
    assert {s["bytes"] for s in prof.samples["memory"]} == {2**22, 2**24, 2**26}


@pytest.mark.parametrize("args, message", [
    (("--chunks", "2,x"), "--chunks: '2,x' is not a list"),
    (("--max-bytes", "4Q"), "--max-bytes: '4Q' is not a size"),
    (("--quick", "--axis-sizes", "3"), "axis size 3 must be between 2 and the device count 8"),
])
def test_profile_script_bad_input_exits_2_with_one_line(tmp_path, args, message):
    out = tmp_path / "p.json"
    r = run_script("calibrate.py", *args, "--out", str(out))
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_committed_cpu_profile_covers_every_kind():
    prof = Profile.load(default_profile_path("cpu", 8))
    assert prof.coverage() == {kind: [2, 4, 8] for kind in COMM_KINDS}
    assert set(prof.gemm) == {"float32", "bfloat16"}
    assert isinstance(prof.memory, MemFit)


@pytest.mark.gpu_aot
def test_memory_chain_is_one_kernel_per_pass_on_gpu():
    """XLA's GPU fusion runs a chain of row-wise norms as one kernel that reads x once (a
    calibration measured 16 TB/s on an H100); the chain must keep one fusion per pass."""
    from oases_jax.planner.calibration.calibrate import _norm_chain
    from oases_jax.targets import get_target, has_gpu_aot

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    devices = get_target("h100:1").devices
    mesh = jax.sharding.Mesh(devices, ("data",))
    x = jax.ShapeDtypeStruct((4096, 256), "float32", sharding=jax.NamedSharding(mesh, jax.P()))
    for calls in (1, 4):
        hlo = jax.jit(_norm_chain(calls)).lower(x).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):]
        assert entry.count(" fusion(") == calls


def test_calibrate_writes_into_a_checkout_never_an_installed_package(tmp_path, monkeypatch):
    import oases_jax.planner.calibration.profile as profile_module

    checkout = tmp_path / "checkout"
    (checkout / "planner" / "profiles").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    monkeypatch.setattr(profile_module, "ROOT", checkout)
    want = checkout / "planner" / "profiles" / "cpu-8.json"
    assert profile_module.default_profile_out("cpu", 8) == want
    installed = tmp_path / "lib" / "python3.12" / "site-packages"
    installed.mkdir(parents=True)
    (installed / "pyproject.toml").write_text("")  # even with one lying about
    monkeypatch.setattr(profile_module, "ROOT", installed)
    with pytest.raises(UserError, match="not a source checkout.*pass --out FILE"):
        profile_module.default_profile_out("cpu", 8)
