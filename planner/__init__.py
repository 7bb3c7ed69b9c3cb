"""The planner, in sub-packages by job, over layouts (`planner.layout`) and JSON plans
(`planner.plan`, `planner.plan_schema`):

    cost/          the overlap-aware cost model: single-op prices, one layer's work replayed by
                   the two-stream `oases_jax.streams`, the one step model, MoE and pipeline stages
    search/        the exact per-layer search (`search.dense`), the 3D search and its stage
                   partitioner, MoE models' search
    verification/  plans checked against their compiled programs, and the ranking of measured
                   plans (imported on use: they load the compile path)
    calibration/   profiles the cost model reads, and the measurements that write them

`make_plan` is the one-call entry point."""

from __future__ import annotations

import jax

from oases_jax.errors import UserError
from oases_jax.hardware import CLUSTERS, ClusterSpec, LinkSpec, compile_targets, detect, get_cluster
from oases_jax.models.config import ModelConfig
from oases_jax.planner.calibration.profile import ROOT, Profile, default_profile_path
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.plan import plan_json
from oases_jax.planner.search.dense import SCHEDULES, search

COST_SOURCES = ("datasheet", "profile", "xla")


def local_cluster(devices=None) -> ClusterSpec:
    """The devices at hand as a cluster: `cpu-N` for CPU devices (host-memory links), the
    GPU target of that model and count otherwise."""
    devices = list(devices if devices is not None else jax.devices())
    n, kind = len(devices), devices[0].device_kind
    if devices[0].platform == "cpu":
        if n == 8:
            return CLUSTERS["cpu-8"]
        link = CLUSTERS["cpu-8"].levels[0][1]
        return ClusterSpec(name=f"cpu-{n}", device="cpu", n_devices=n, levels=((n, link),))
    spec = detect(kind)
    if spec is None:
        raise UserError(f"no datasheet for device {kind!r}; describe it in a cluster JSON "
                        "(docs/planner.md) and pass --cluster FILE")
    return get_cluster(f"{spec.name}:{n}")


def load_profile(source: str, cluster: ClusterSpec, path: str | None = None):
    """The calibration profile for a cost source: None for `datasheet`; for `profile` and
    `xla`, `path` or the default profile of the cluster's device and size
    (`planner/profiles/DEVICE-N.json`, `planner/profiles/xla-DEVICE-N.json`)."""
    if source not in COST_SOURCES:
        raise UserError(f"unknown --cost-source {source!r}; choose one of "
                        f"{', '.join(COST_SOURCES)}")
    if source == "datasheet":
        return None
    if source == "xla" and path is None:
        path = default_xla_profile(cluster)
    p = path or default_profile_path(cluster.device, cluster.n_devices)
    prof = Profile.load(p)
    if prof.source != source:
        raise UserError(f"profile {str(p)!r} holds {prof.source!r} costs, not {source!r}; "
                        f"pass the matching --profile")
    return prof


def default_xla_profile(cluster: ClusterSpec):
    """`planner/profiles/xla-DEVICE-N.json` of the cluster, or an error naming the sweep that
    writes it. XLA's estimator prices programs compiled for a GPU target (`oases_jax.targets`)."""
    n, dev = cluster.n_devices, cluster.device
    if dev not in compile_targets():
        raise UserError(f"--cost-source xla on cluster {cluster.name!r}: XLA's estimator prices "
                        f"programs compiled for {', '.join(compile_targets())} GPUs, not "
                        f"{dev!r}; use --cost-source datasheet or profile, or pass an xla "
                        "--profile FILE")
    p = default_profile_path(f"xla-{dev}", n)
    if not p.is_file():
        raise UserError(f"--cost-source xla: no XLA profile for {cluster.name!r} ({n} x {dev}) "
                        f"at {p.relative_to(ROOT)}; write it with `python scripts/xla_sweep.py "
                        f"--target {dev}:{n} --out {p.relative_to(ROOT)}` or pass --profile FILE")
    return p


def make_plan(cfg: ModelConfig, *, model: str, cluster: ClusterSpec, global_batch: int,
              seq_len: int, memory_fraction: float | None = None, profile=None,
              cost_source: str = "datasheet", schedules=None) -> tuple[dict, object]:
    """Search and return (plan JSON, SearchResult): an MoE model's data x expert x tensor
    search (`planner.search.moe`), a dense model's per-layer one (`planner.search.dense`)."""
    hw = Hardware.of(cluster, profile)
    find = search
    if cfg.moe:
        from oases_jax.planner.search.moe import search_moe as find
    result = find(cfg, hw, global_batch=global_batch, seq_len=seq_len,
                  memory_fraction=memory_fraction, schedules=schedules or SCHEDULES)
    return plan_json(result, model=model, cfg=cfg, cluster=cluster.name,
                     cost_source=cost_source), result


__all__ = ["COST_SOURCES", "ClusterSpec", "LinkSpec", "default_xla_profile", "get_cluster",
           "load_profile", "local_cluster", "make_plan"]
