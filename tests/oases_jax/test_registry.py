"""The schedule registry: records, derived lists, and the XLA options of mixed programs."""

import dataclasses
import types

import pytest

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec


def test_every_record_is_consistent():
    for name, s in registry.SCHEDULES.items():
        assert s.name == name
        assert s.projection in registry.PROJECTIONS
        assert (s.manual_projection is not None) == s.sub_batches, name
        assert not s.overlapped_stack or s.sub_batches, name
        assert s.rules in ("tp", "tp_sp", "primepar")
        assert s.gpu_options["xla_gpu_enable_latency_hiding_scheduler"] is True


def test_lists_derive_from_the_records():
    assert registry.names(sequence_parallel=True) == (
        "megatron_sp", "collective_matmul", "oases_sp", "oases_cm", "xla_auto")
    assert registry.names(rings=True) == ("collective_matmul", "oases_cm")
    assert registry.names(sub_batches=True) == ("oases", "oases_sp", "oases_cm")
    assert "xla_auto" not in registry.names(planned=True)
    assert "oases_sp" not in registry.names(planned=True)  # priced, not yet searched


def test_runner_and_rules():
    oases, megatron = registry.get("oases"), registry.get("megatron")
    assert oases.runner(2, 4) == "overlapped_stack"
    assert oases.runner(1, 4) == "manual_layer"
    assert oases.runner(2, 1) == "scan"  # nothing to overlap without a tensor split
    assert registry.get("oases_cm").runner(2, 4) == "manual_layer"
    assert registry.get("oases_sp").runner(2, 4) == "overlapped_stack"
    assert registry.get("oases_sp").rules_for("tp") == "tp_sp"
    assert megatron.runner(2, 4) == "scan"
    assert registry.get("megatron_sp").rules_for("tp") == "tp_sp"
    assert megatron.rules_for("tp_sp") == "tp"
    assert megatron.rules_for("fsdp_tp") == "fsdp_tp"
    assert registry.get("primepar").rules_for("tp") == "primepar"


def test_unknown_schedule_names_the_choices():
    with pytest.raises(UserError, match="choose one of megatron, megatron_sp"):
        registry.get("megatrom")
    with pytest.raises(UserError, match="megatrom"):
        LayerSpec(schedule="megatrom")


def test_mixed_schedules_get_the_union_of_their_gpu_options():
    opts = registry.compiler_options(("megatron", "collective_matmul", "oases", "primepar"),
                                     "gpu")
    assert opts == {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 3,  # primepar's, not 2
        "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
        "xla_gpu_collective_permute_combine_threshold_bytes": 0,
        "xla_disable_hlo_passes": "dot-merger",
    }
    assert registry.compiler_options("oases", "gpu") == dict(registry.get("oases").gpu_options)
    assert registry.compiler_options(("oases", "collective_matmul"), "cpu") == {}


def test_disabled_passes_are_joined(monkeypatch):
    extra = dataclasses.replace(registry.get("megatron"), name="extra", gpu_options={
        "xla_disable_hlo_passes": "all-gather-combiner,dot-merger"})
    monkeypatch.setattr(registry, "SCHEDULES",
                        types.MappingProxyType({**registry.SCHEDULES, "extra": extra}))
    opts = registry.compiler_options(("oases", "extra"), "gpu")
    assert opts["xla_disable_hlo_passes"] == "dot-merger,all-gather-combiner"
