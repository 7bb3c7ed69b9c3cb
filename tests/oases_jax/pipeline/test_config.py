"""The typed pipeline config: the command line's text parsed into values, the checks that need
only the schedule's record, Merak's ratios expanded per stage (by hand), and a plan's stage
section read into a config and written back unchanged."""

from fractions import Fraction as Fr

import pytest

from oases_jax.errors import UserError
from oases_jax.pipeline.config import PipelineConfig


def one_line(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_flags_parse_into_values():
    got = PipelineConfig.from_flags(pipeline="1f1b", stage_layers="5,6,6,7", remat_ratios="0.8",
                                    fused_ticks="auto", split_head="off")
    assert got == PipelineConfig(schedule="1f1b", stage_layers=(5, 6, 6, 7),
                                 remat_ratios=(Fr(4, 5),))
    assert got.fused_ticks is None and got.split_head is False and got.virtual_stages == 0
    got = PipelineConfig.from_flags(pipeline="interleaved", virtual_stages=2,
                                    remat_ratios="0.8, 0.7,0.4,0", backward_ticks=2,
                                    fused_ticks="off", split_head="on")
    assert got == PipelineConfig(schedule="interleaved", virtual_stages=2,
                                 remat_ratios=(Fr(4, 5), Fr(7, 10), Fr(2, 5), Fr(0)),
                                 backward_ticks=2, fused_ticks=False, split_head=True)
    assert PipelineConfig.from_flags(pipeline="1f1b", fused_ticks="on").fused_ticks is True
    # Empty text is the default, as the flags' own defaults are.
    assert PipelineConfig.from_flags(pipeline="gpipe", stage_layers="", remat_ratios="") == \
        PipelineConfig(schedule="gpipe")
    assert PipelineConfig.from_flags(pipeline=None) is None


def test_values_are_held_exactly():
    """Sequences become tuples, ratios exact fractions (a float by its shortest decimal)."""
    cfg = PipelineConfig(schedule="gpipe", stage_layers=[3, 1], remat_ratios=[0.1, 1])
    assert cfg.stage_layers == (3, 1) and cfg.remat_ratios == (Fr(1, 10), Fr(1))
    assert hash(cfg) == hash(PipelineConfig(schedule="gpipe", stage_layers=(3, 1),
                                            remat_ratios=(Fr(1, 10), 1)))


def test_merak_rule_from_r0_by_hand():
    """r_i = 1 - (1 - r0)(S-1)/(S-1-i): S=4, r0=0.8: 1 - 0.6/3, 1 - 0.6/2, 1 - 0.6/1, 0. Under
    Merak's schedule stage S-2 takes stage S-3's ratio. One per stage is kept as given."""
    r0 = PipelineConfig.from_flags(pipeline="1f1b", remat_ratios="0.8")
    assert r0.ratios_for(4) == (Fr(4, 5), Fr(7, 10), Fr(2, 5), 0)
    assert r0.ratios_for(2) == (Fr(4, 5), 0)  # 1 - 0.2 * 1/1, and the last stage
    shifted = PipelineConfig(schedule="merak", remat_ratios=(0.8,))
    assert shifted.ratios_for(4) == (Fr(4, 5), Fr(7, 10), Fr(7, 10), 0)
    each = PipelineConfig(schedule="1f1b", remat_ratios=(0.6, 0.3, 1, 0))
    assert each.ratios_for(4) == (Fr(3, 5), Fr(3, 10), 1, 0)
    assert PipelineConfig(schedule="1f1b").ratios_for(4) is None
    assert "3 recompute ratios (0.6, 0.3, 1) for S=4 stages" in one_line(
        PipelineConfig(schedule="1f1b", remat_ratios=(0.6, 0.3, 1)).ratios_for, 4)


@pytest.mark.parametrize(("flags", "words"), [
    ({"stage_layers": "5,6,x,7"}, "stage layers '5,6,x,7' are not integers: give comma-separated "
                                  "counts, one per stage, e.g. --stage-layers 5,6,6,7"),
    ({"stage_layers": "0,8,8,8"}, "stage layers 0,8,8,8 leave a stage without layers"),
    ({"remat_ratios": "1.2"}, "first-stage recompute ratio r0='1.2' is outside [0, 1]"),
    ({"remat_ratios": "0.5,abc"}, "recompute ratio of stage 1='abc' is not a number"),
    ({"fused_ticks": "yes"}, "unknown --fused-ticks 'yes': choose auto, on or off"),
    ({"split_head": "maybe"}, "unknown --split-head 'maybe': choose on or off"),
    ({"backward_ticks": 9}, "--backward-ticks 9 must be 1 to 8"),
    ({"fused_ticks": "on", "backward_ticks": 2},
     "--fused-ticks on runs each backward in one tick, not --backward-ticks 2"),
    ({"virtual_stages": 3}, "--virtual-stages 3 needs a schedule with model chunks per stage"),
    ({"virtual_stages": -1}, "--virtual-stages -1 must be >= 2"),
    ({"pipeline": "zb_h2"}, "unknown --pipeline 'zb_h2'"),
    ({"pipeline": None, "stage_layers": "1,1"},
     "--stage-layers 1,1 needs --pipeline and a stage mesh axis"),
    ({"pipeline": None, "fused_ticks": "on"}, "--fused-ticks on needs --pipeline"),
    ({"pipeline": None, "virtual_stages": 2}, "--virtual-stages 2 needs --pipeline"),
])
def test_bad_text_is_one_line(flags, words):
    flags = {"pipeline": "1f1b"} | flags
    assert words in one_line(PipelineConfig.from_flags, **flags)


def test_typed_values_are_checked():
    assert "is text" in one_line(PipelineConfig, schedule="1f1b", stage_layers="5,6")
    assert "is text" in one_line(PipelineConfig, schedule="1f1b", remat_ratios="0.8")
    assert "not integers" in one_line(PipelineConfig, schedule="1f1b", stage_layers=(1.5, 2))
    assert "must be True, False or None" in one_line(PipelineConfig, schedule="1f1b",
                                                     fused_ticks="on")
    assert "must be True or False" in one_line(PipelineConfig, schedule="1f1b", split_head="on")


def test_per_stage_flags_are_spelled_as_given():
    cfg = PipelineConfig.from_flags(pipeline="1f1b", stage_layers="5,6,6,7",
                                    remat_ratios="0.8,1/3", backward_ticks=2, fused_ticks="off",
                                    split_head="on")
    assert cfg.per_stage_flags() == (("--stage-layers", "5,6,6,7"), ("--remat-ratios", "0.8,1/3"),
                                     ("--backward-ticks", "2"), ("--fused-ticks", "off"),
                                     ("--split-head", "on"))
    assert PipelineConfig(schedule="1f1b").per_stage_flags() == ()


def test_json_round_trip():
    cfg = PipelineConfig(schedule="merak", stage_layers=(2, 2), remat_ratios=(Fr(1, 3), 0),
                         fused_ticks=True)
    d = cfg.to_json()
    assert d["remat_ratios"] == ["1/3", "0"] and d["stage_layers"] == [2, 2]
    assert PipelineConfig(**d) == cfg


ENTRY = {"schedule": "1f1b", "stages": 4, "stage_layers": [5, 6, 6, 7],
         "remat_ratios": ["4/5", "7/10", "2/5", "0"], "virtual_stages": 1, "backward_ticks": 2,
         "fused_ticks": False, "split_head": True, "predicted_pipeline_s": 0.5,
         "predicted_stage_memory_bytes": [1.0, 2.0, 3.0, 4.0], "exact": True}


def test_plan_entry_round_trip():
    """A plan's stage section -> PipelineConfig -> the same section."""
    from oases_jax.planner.plan import pipeline_config, pipeline_entry
    from oases_jax.planner.plan_schema import PipelineEntry

    cfg = pipeline_config(PipelineEntry.model_validate(ENTRY))
    assert cfg == PipelineConfig(schedule="1f1b", stage_layers=(5, 6, 6, 7), virtual_stages=1,
                                 remat_ratios=(Fr(4, 5), Fr(7, 10), Fr(2, 5), 0),
                                 backward_ticks=2, fused_ticks=False, split_head=True)
    predicted = {k: ENTRY[k] for k in ("predicted_pipeline_s", "predicted_stage_memory_bytes",
                                       "exact")}
    assert pipeline_entry(cfg, stages=4, num_layers=24, **predicted) == ENTRY
    chunked = {**ENTRY, "schedule": "interleaved", "stages": 2, "stage_layers": [12, 12],
               "remat_ratios": ["1", "0"], "virtual_stages": 2}
    cfg = pipeline_config(PipelineEntry.model_validate(chunked))
    assert cfg.virtual_stages == 2
    assert pipeline_entry(cfg, stages=2, num_layers=24, **predicted) == chunked


def test_plan_entry_writes_every_stage_out():
    """The uniform split and Merak's rule from r0 written stage by stage; the runtime's rules
    (backward ticks, tick table) stay absent."""
    from oases_jax.planner.plan import pipeline_entry

    cfg = PipelineConfig(schedule="merak", remat_ratios=(0.8,))
    assert pipeline_entry(cfg, stages=4, num_layers=26) == {
        "schedule": "merak", "stages": 4, "stage_layers": [7, 7, 6, 6],
        "remat_ratios": ["4/5", "7/10", "7/10", "0"], "virtual_stages": 1,
        "split_head": False}
    assert pipeline_entry(PipelineConfig(schedule="1f1b"), stages=2,
                          num_layers=4)["remat_ratios"] == ["0", "0"]
