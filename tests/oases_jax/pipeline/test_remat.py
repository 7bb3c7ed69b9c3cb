"""Merak's stage-aware recomputation ratios and per-stage layer counts, by hand arithmetic."""

from fractions import Fraction as Fr

import pytest

from oases_jax.errors import UserError
from oases_jax.pipeline.remat import (
    check_ratios,
    ratio_text,
    recomputed_layers,
    resolve_stage_layers,
    stage_ratios,
)


def test_merak_ratios_by_hand():
    """r_i = 1 - (1 - r0)(S-1)/(S-1-i): S=4, r0=0.8: 1 - 0.2*3/3, 1 - 0.2*3/2, 1 - 0.2*3/1, 0."""
    assert stage_ratios(4, 0.8) == (Fr(4, 5), Fr(7, 10), Fr(2, 5), 0)
    # S=8: 1 - 1.4/7, 1 - 1.4/6 = 23/30, 1 - 1.4/5, 1 - 1.4/4, 1 - 1.4/3 = 8/15, 1 - 1.4/2, then
    # 1 - 1.4/1 < 0 clamps to 0, and the last stage is 0.
    assert stage_ratios(8, "0.8") == (Fr(4, 5), Fr(23, 30), Fr(18, 25), Fr(13, 20), Fr(8, 15),
                                      Fr(3, 10), 0, 0)


def test_the_rule_keeps_unrecomputed_memory_level():
    ratios = stage_ratios(6, 0.9)
    assert all((1 - r) * (5 - i) == Fr(1, 10) * 5 for i, r in enumerate(ratios[:-1]))


def test_edges():
    assert stage_ratios(1, 0.8) == (Fr(4, 5),)  # no pipeline: the one stage keeps r0
    assert stage_ratios(4, 1) == (1, 1, 1, 0)
    assert stage_ratios(4, 0) == (0, 0, 0, 0)  # 1 - 3/2 < 0 and 1 - 3/1 < 0 clamp to 0
    assert stage_ratios(2, 0.5) == (Fr(1, 2), 0)
    assert stage_ratios(4, 0.8, shifted=True) == (Fr(4, 5), Fr(7, 10), Fr(7, 10), 0)
    assert stage_ratios(2, 0.8, shifted=True) == (Fr(4, 5), 0)


def test_recomputed_layers_floor_exactly():
    """floor(n_i r_i): 5*0.8 = 4, 6*0.7 = 4.2, 6*0.4 = 2.4, 0. With S=3, r0=0.7 the middle ratio
    is 1 - 0.3*2 = 0.4 exactly, so 5 layers recompute 2 (floats give 0.3999... and 1)."""
    assert recomputed_layers((5, 6, 6, 7), stage_ratios(4, 0.8)) == (4, 4, 2, 0)
    assert recomputed_layers((5, 5, 5), stage_ratios(3, 0.7)) == (3, 2, 0)
    assert recomputed_layers((4, 4), (1, 0.5)) == (4, 2)


def test_explicit_ratios():
    assert check_ratios(["0.8", "0.7", "0.4", "0"], 4) == (Fr(4, 5), Fr(7, 10), Fr(2, 5), 0)
    assert check_ratios([1, 0.5, 0], 3) == (1, Fr(1, 2), 0)


def test_ratio_text_is_the_flags_spelling():
    assert [ratio_text(r) for r in (Fr(4, 5), Fr(1), Fr(0), Fr(1, 8), Fr(1, 3))] == [
        "0.8", "1", "0", "0.125", "1/3"]


def test_stage_layers():
    assert resolve_stage_layers(None, 24, 4) == (6, 6, 6, 6)
    assert resolve_stage_layers(None, 26, 4) == (7, 7, 6, 6)  # the first L mod S get one more
    assert resolve_stage_layers((5, 6, 6, 7), 24, 4) == (5, 6, 6, 7)
    assert resolve_stage_layers([5, 6, 6, 7], 24, 4) == (5, 6, 6, 7)
    assert resolve_stage_layers((4, 6, 6, 8), 24, 4, chunks=2) == (4, 6, 6, 8)  # v=2


def one_line(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_input_is_one_line():
    msg = one_line(resolve_stage_layers, (5, 6, 6, 6), 24, 4)
    assert "sum to 23" in msg and "24 layers" in msg and "e.g. 6,6,6,6" in msg
    assert "3 counts for S=4" in one_line(resolve_stage_layers, (8, 8, 8), 24, 4)
    assert "3 layers cannot fill S=4" in one_line(resolve_stage_layers, None, 3, 4)
    msg = one_line(resolve_stage_layers, (5, 6, 6, 7), 24, 4, chunks=2)
    assert "5,6,6,7 do not split into v=2" in msg and "e.g. 6,6,6,6" in msg
    msg = one_line(resolve_stage_layers, None, 26, 4, chunks=2)  # uniform 7,7,6,6
    assert "7,7,6,6 do not split into v=2" in msg and "e.g. 8,6,6,6" in msg
    msg = one_line(resolve_stage_layers, None, 25, 4, chunks=2)
    assert "25 layers need v dividing them" in msg
    assert "r0=1.2" in one_line(stage_ratios, 4, 1.2)
    assert "not a number" in one_line(stage_ratios, 4, "abc")
    assert "3 recompute ratios (0.8, 0.7, 0.4)" in one_line(check_ratios, [Fr(4, 5), Fr(7, 10),
                                                                        Fr(2, 5)], 4)
    assert "stage 1=-0.1" in one_line(check_ratios, [0.5, -0.1], 2)
    assert "S=0" in one_line(stage_ratios, 0, 0.5)
