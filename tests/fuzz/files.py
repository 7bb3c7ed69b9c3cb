"""Mutated cluster JSON and calibration profiles, each run through `plan.py --cluster FILE` and
`plan.py --cost-source profile --profile FILE` (with the search: it prices with what was read)."""

from __future__ import annotations

import json
import os
import pathlib
import random

from tests.fuzz import targets
from tests.fuzz.harness import Case
from tests.fuzz.jsontext import Raw, dumps, label, nested, numeric_paths, removed, replaced

SEED = 2020
ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAN = ("--model", "tiny", "--global-batch", "8", "--seq-len", "32")


def base_clusters() -> dict[str, dict]:
    """A built-in two-level cluster, one of a device the project does not know (with its
    datasheet), and a CPU cluster without `device_spec`."""
    from oases_jax.hardware import get_cluster

    h100 = json.loads(json.dumps(get_cluster("h100-32").to_json()))
    custom = json.loads(json.dumps(get_cluster("cpu-8").to_json()))
    custom.update(name="fuzz-4", device="fuzzgpu", n_devices=8)
    custom["device_spec"].update(name="fuzzgpu", match=["FuzzGPU"])
    cpu = {k: v for k, v in get_cluster("cpu-8").to_json().items() if k != "device_spec"}
    return {"h100": h100, "custom": custom, "cpu": json.loads(json.dumps(cpu))}


def base_profiles() -> dict[str, dict]:
    """The repository's measured CPU profile, and a small one without memory fit or samples."""
    full = json.loads((ROOT / "planner" / "profiles" / "cpu-8.json").read_text())
    small = {k: v for k, v in full.items() if k not in ("samples", "memory")}
    small["comm"] = full["comm"][:6]
    return {"measured": full, "small": small}


def _cluster_case(path: str):
    from oases_jax import hardware

    def run():
        devices = dict(hardware.DEVICES)  # a file may register its device: forget it after
        try:
            targets.plan(*PLAN, "--cluster", path)
        finally:
            hardware.DEVICES.clear()
            hardware.DEVICES.update(devices)
    return run


def _profile_case(path: str):
    return lambda: targets.plan(*PLAN, "--cluster", "cpu-8", "--cost-source", "profile",
                                "--profile", path)


def file_cases(tmp: pathlib.Path) -> list[Case]:
    rng = random.Random(SEED)
    cases: list[Case] = []

    def add(kind: str, category: str, name: str, text: str | bytes, expect="reject",
            needle=None, make=None) -> None:
        path = tmp / f"{kind}-{len(cases):03d}.json"
        if make is not None:
            make(path)
        elif isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        run = _cluster_case if kind == "cluster" else _profile_case
        cases.append(Case(f"{kind}:{category}", name, run(str(path)), expect, needle))

    clusters, profiles = base_clusters(), base_profiles()
    for n, c in clusters.items():
        add("cluster", "valid", n, dumps(c), "accept")
    for n, p in profiles.items():
        add("profile", "valid", n, dumps(p), "accept")
    add("profile", "valid", "a collective too fast to fit (null bandwidth)",
        dumps(replaced(profiles["small"], ("comm", 0, "bytes_per_s"), None)), "accept")

    cluster_wrong = [(("n_devices",), v) for v in (8.5, True, "32", None, [32])]
    cluster_wrong += [(("levels", 0, 0), 8.0), (("levels", 0, 1, "bytes_per_s"), "fast"),
                      (("levels", 0, 1), [450e9, 3e-6]), (("levels",), {"8": "nvlink"}),
                      (("device",), 5), (("name",), None), (("levels", 0), [8]),
                      (("device_spec", "memory_bytes"), "80GB"),
                      (("device_spec", "peak_flops"), [1e15]),
                      (("device_spec", "match"), "H100"),
                      (("device_spec", "fused_attention"), "yes")]
    for path, value in cluster_wrong:
        add("cluster", "wrong_type", f"{label(path)} = {value!r}",
            dumps(replaced(clusters["h100"], path, value)), needle=label(path))
    profile_wrong = [(("n_devices",), 8.0), (("n_devices",), True), (("source",), 1),
                     (("gemm", "float32", "flops_per_s"), "fast"), (("gemm",), []),
                     (("comm", 0, "n"), 2.5), (("comm", 0, "kind"), None), (("comm",), {}),
                     (("memory",), [1, 2]), (("meta",), "today"), (("samples",), [1]),
                     (("samples", "gemm", 0, "m"), "512"), (("version",), "1")]
    for path, value in profile_wrong:
        add("profile", "wrong_type", f"{label(path)} = {value!r}",
            dumps(replaced(profiles["measured"], path, value)), needle=label(path))

    for kind, bases in (("cluster", clusters), ("profile", profiles)):
        for _ in range(8):
            n = rng.choice(list(bases))
            path = rng.choice(numeric_paths(bases[n]))
            text = rng.choice(["Infinity", "-Infinity", "NaN", "1e999"])
            add(kind, "non_finite", f"{n}: {label(path)} = {text}",
                dumps(replaced(bases[n], path, Raw(text))), needle=label(path))

    for path, value in ((("n_devices",), 0), (("n_devices",), -8), (("n_devices",), 10**12),
                        (("levels", 0, 1, "bytes_per_s"), 0), (("levels", 0, 1, "latency_s"), -1),
                        (("device_spec", "memory_bytes"), 0),
                        (("device_spec", "peak_flops", "float32"), -1e12),
                        (("device_spec", "hbm_bytes_per_s"), 0),
                        # finite, positive and absurd: every price would be inf or nan
                        (("levels", 0, 1, "bytes_per_s"), 1e-300),
                        (("levels", 0, 1, "latency_s"), 1e300),
                        (("device_spec", "peak_flops", "float32"), 1e-300),
                        (("device_spec", "hbm_bytes_per_s"), 1e30),
                        (("device_spec", "memory_bytes"), 1e30)):
        base = clusters["custom" if path[0] == "device_spec" else "h100"]
        add("cluster", "range", f"{label(path)} = {value}", dumps(replaced(base, path, value)),
            needle=label(path))
    for path, value in ((("n_devices",), 0), (("gemm", "float32", "flops_per_s"), 0),
                        (("gemm", "float32", "overhead_s"), -1e-6), (("comm", 0, "n"), 1),
                        (("comm", 0, "bytes_per_s"), -5), (("comm", 0, "latency_s"), -1),
                        (("memory", "bytes_per_s"), 0), (("samples", "gemm", 0, "seconds"), -1),
                        (("n_devices",), 10**15)):
        add("profile", "range", f"{label(path)} = {value}",
            dumps(replaced(profiles["measured"], path, value)), needle=label(path))

    for name, doc, needle in (
            ("unknown device without device_spec", {**clusters["cpu"], "device": "tpu9"},
             "device"),
            ("device_spec of another name",
             replaced(clusters["custom"], ("device_spec", "name"), "other"), "device_spec"),
            ("a built-in device with other numbers",
             replaced(clusters["h100"], ("device_spec", "memory_bytes"), 2**30), "h100"),
            ("spans shrink", replaced(clusters["h100"], ("levels",),
                                      clusters["h100"]["levels"][::-1]), "levels"),
            ("spans stop short of n_devices", {**clusters["h100"], "n_devices": 64}, "levels"),
            ("no levels", {**clusters["h100"], "levels": []}, "levels"),
            ("missing n_devices", removed(clusters["h100"], ("n_devices",)), "n_devices"),
            ("unknown key", {**clusters["h100"], "n_device": 32}, "n_device"),
            ("top level a list", [clusters["h100"]], None)):
        add("cluster", "structure", name, dumps(doc), needle=needle)
    for name, doc, needle in (
            ("unknown source", {**profiles["measured"], "source": "guess"}, "source"),
            ("unknown collective", replaced(profiles["measured"], ("comm", 0, "kind"), "gossip"),
             "comm[0].kind"),
            ("xla profile for --cost-source profile", {**profiles["measured"], "source": "xla"},
             "xla"),
            ("format missing", removed(profiles["measured"], ("format",)), "format"),
            ("version 2", {**profiles["measured"], "version": 2}, "version"),
            ("missing gemm", removed(profiles["small"], ("gemm",)), "gemm"),
            ("top level null", None, None),
            ("deep meta", {**profiles["small"], "meta": nested(100_000, "dict")}, None),
            ("meta nested 50 deep", {**profiles["small"], "meta": nested(50, "dict")}, "meta")):
        add("profile", "structure", name, dumps(doc), needle=needle)

    cluster_text = dumps(clusters["h100"])
    add("cluster", "duplicate_keys", "n_devices twice",
        cluster_text.replace('"n_devices": 32', '"n_devices": 32, "n_devices": 8'),
        needle="n_devices")
    add("profile", "duplicate_keys", "version twice",
        dumps(profiles["small"]).replace('"version": 1', '"version": 1, "version": 2'),
        needle="version")
    for kind in ("cluster", "profile"):
        add(kind, "syntax", "truncated", cluster_text[:100])
        add(kind, "syntax", "not UTF-8", b"\xff\xfe{}")
        add(kind, "syntax", "empty", "")
        add(kind, "deep_nesting", "top level 100000 deep", "[" * 100_000 + "]" * 100_000)
        add(kind, "file_kind", "a directory", "", make=lambda p: p.mkdir())
        add(kind, "file_kind", "a FIFO", "", make=os.mkfifo)
        add(kind, "file_kind", "a link to /dev/zero", "",
            make=lambda p: p.symlink_to("/dev/zero"))
    return cases
