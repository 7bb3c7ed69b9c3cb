"""cuDNN's fused-attention custom calls priced from their shapes (FLOPs, roofline time, XLA's
estimate), and the attention a program holds, on hand-written HLO checked by hand arithmetic."""

import json

import pytest

from oases_jax.hardware import get_cluster
from oases_jax.tools.analysis import attention
from oases_jax.tools.analysis.hlo import parse_module
from oases_jax.tools.analysis.program import Program, analyze_text
from oases_jax.tools.analysis.simulate import Simulator, roofline_time
from oases_jax.tools.analysis.xla_compile import fused_attention_prices
from oases_jax.tools.analysis.xla_estimate import estimate_from_hlo_text

# Per-device shapes of Llama-2 7B at sequence 2048 on data=2, tensor=4: B=4, H=8, L=2048, K=128.
B, H, L, K = 4, 8, 2048, 128
N = B * H * L * L  # score entries
BLHK = f"bf16[{B},{L},{H},{K}]{{3,2,1,0}}"
STATS = f"f32[{B},{H},{L}]{{2,1,0}}"


def _config(mask: str = "CAUSAL", scores: bool = True, bwd: bool = False) -> str:
    cfg = {"mask_type": mask, "is_flash_attention": True, "fmha_scale": K**-0.5}
    if scores:
        cfg["intermediate_tensor_shape"] = {"element_type": "BF16",
                                            "dimensions": [str(d) for d in (B, H, L, L)]}
    if not bwd:
        cfg["bmm1_dot_dimension_numbers"] = {
            "lhs_contracting_dimensions": ["3"], "rhs_contracting_dimensions": ["3"],
            "lhs_batch_dimensions": ["0", "2"], "rhs_batch_dimensions": ["0", "2"]}
    return json.dumps({"operation_queue_id": "0", "cudnn_fmha_backend_config": cfg})


def _program(mask: str = "CAUSAL", scores: bool = True) -> str:
    """Forward and backward of one attention, as XLA writes them for a GPU."""
    fwd = _config(mask, scores)
    bwd = _config(mask, scores, bwd=True)
    fwd_call = (f"custom-call(%q, %k, %v), custom_call_target=\"__cudnn$fmhaSoftmax\", "
                f'metadata={{op_name="attn" scheduling_name="fwd.sched"}}, backend_config={fwd}')
    bwd_call = ("custom-call(%q, %k, %v, %stats, %do, /*index=5*/%o), "
                f'custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={bwd}')
    return f"""HloModule attn, entry_computation_layout={{}}

ENTRY %main (q: {BLHK}, k: {BLHK}, v: {BLHK}, do: {BLHK}) -> {BLHK} {{
  %q = {BLHK} parameter(0)
  %k = {BLHK} parameter(1)
  %v = {BLHK} parameter(2)
  %do = {BLHK} parameter(3)
  %fwd = ({BLHK}, {STATS}, u8[0]{{0}}) {fwd_call}
  %o = {BLHK} get-tuple-element(%fwd), index=0
  %stats = {STATS} get-tuple-element(%fwd), index=1
  %bwd = ({BLHK}, {BLHK}, {BLHK}, u8[0]{{0}}) {bwd_call}
  ROOT %dq = {BLHK} get-tuple-element(%bwd), index=0
}}
"""


@pytest.fixture(scope="module")
def program() -> Program:
    return Program(_program())


def _calls(program: Program):
    comp = program.comp(program.module.entry)
    return comp, comp.by_name["fwd"], comp.by_name["bwd"]


def test_flops_of_causal_forward_and_backward_by_hand(program):
    comp, fwd, bwd = _calls(program)
    assert attention.is_fused_attention(fwd) and attention.is_backward(bwd)
    assert attention.attention_shape(fwd, comp) == (B * H, L, L, K, K)
    # forward: QK^T and PV, 2·N·K each, halved by the causal mask
    assert attention.fused_attention_flops(fwd, comp) == 2 * N * K == 34_359_738_368
    # backward: QK^T again, dV, dP, dQ, dK: five GEMMs of 2·N·K, halved: 2.5x the forward
    assert attention.fused_attention_flops(bwd, comp) == 5 * N * K == 85_899_345_920
    assert program.instr_flops(comp, fwd) == 2 * N * K
    assert program.flops_of(program.module.entry) == 7 * N * K


def test_no_mask_doubles_and_shapes_read_without_the_recorded_scores():
    for mask, scores, factor in (("NO_MASK", True, 2), ("CAUSAL", False, 1)):
        p = Program(_program(mask, scores))
        comp, fwd, bwd = _calls(p)
        assert attention.fused_attention_flops(fwd, comp) == factor * 2 * N * K
        assert attention.fused_attention_flops(bwd, comp) == factor * 5 * N * K


def test_roofline_time_prices_the_call_like_a_gemm(program):
    comp, fwd, bwd = _calls(program)
    h100 = get_cluster("h100:8").device_spec
    q_bytes, stats_bytes = B * L * H * K * 2, B * H * L * 4
    # forward reads Q, K, V and writes O and the softmax statistics (no scores)
    fwd_bytes = 4 * q_bytes + stats_bytes
    assert program.traffic_bytes(comp, fwd) == fwd_bytes
    fwd_s = roofline_time(program, comp, fwd, h100)
    assert fwd_s == pytest.approx(max(2 * N * K / 989e12, fwd_bytes / 3.35e12))
    assert fwd_s == pytest.approx(34.74e-6, rel=1e-3)  # compute-bound: 34.4 GFLOP at 989 TFLOP/s
    bwd_s = roofline_time(program, comp, bwd, h100)
    assert bwd_s == pytest.approx(5 * N * K / 989e12)
    sim = Simulator(program, get_cluster("h100:8")).run()
    assert sim.compute_s == pytest.approx(fwd_s + bwd_s)
    # and a fused-attention call counts as a GEMM for overlap windows
    assert program.is_gemm(fwd) and program.is_gemm(bwd)


def test_xla_estimate_takes_the_roofline_price(program):
    h100 = get_cluster("h100:8").device_spec
    prices = fused_attention_prices(program, h100)
    comp, fwd, bwd = _calls(program)
    assert set(prices) == {"fwd", "fwd.sched", "bwd"}  # by name and by scheduling name
    assert prices["bwd"] == pytest.approx(roofline_time(program, comp, bwd, h100))
    plain = estimate_from_hlo_text(program.text)
    assert plain.step_s == 0 and plain.unpriced_ops == 2 and plain.fused_attention is None
    est = estimate_from_hlo_text(program.text, prices=prices)
    assert est.step_s == pytest.approx(prices["fwd"] + prices["bwd"])
    assert est.fused_attention == {"calls": 2, "xla_s": 0.0,
                                   "priced_s": pytest.approx(est.step_s)}
    assert est.unpriced_ops == 0 and any("fused-attention" in n for n in est.notes)


def _dot_program(lhs: tuple, rhs: tuple, out: tuple, batch: bool = True) -> str:
    """One dot contracting lhs dim 2 (1 unbatched) with rhs dim 1 (0 unbatched)."""
    def t(dims):
        return f"bf16[{','.join(map(str, dims))}]{{{','.join(map(str, range(len(dims))[::-1]))}}}"
    dims = ("lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, "
            "rhs_contracting_dims={1}" if batch else
            "lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    return f"""HloModule d, entry_computation_layout={{}}

ENTRY %main (a: {t(lhs)}, b: {t(rhs)}) -> {t(out)} {{
  %a = {t(lhs)} parameter(0)
  %b = {t(rhs)} parameter(1)
  ROOT %d = {t(out)} dot(%a, %b), {dims}
}}
"""


def test_attention_kernel_reads_the_program(program):
    assert attention.attention_kernel(program.module) == "cudnn_flash"
    # S = Q K^T as XLA writes it with grouped heads merged: [B·G, R·L, K] x [B·G, K, L]
    scores = _dot_program((8, 4096, 128), (8, 128, 2048), (8, 4096, 2048))
    assert attention.attention_kernel(parse_module(scores)) == "materialised"
    analysis, _ = analyze_text(scores)
    assert analysis.flops == 2 * 8 * 4096 * 2048 * 128
    # P V contracts the keys; a projection has no batch dims: neither holds scores
    pv = _dot_program((8, 4096, 2048), (8, 2048, 128), (8, 4096, 128))
    proj = _dot_program((8192, 4096), (4096, 8192), (8192, 8192), batch=False)
    for text in (pv, proj):
        assert attention.attention_kernel(parse_module(text)) == "none"
