"""Kernel-name categories and the decomposition arithmetic, on hand-made event lists."""
import math

import pytest
from hypothesis import given, strategies as st

from benchmarks.categories import CATEGORY_NAMES, categorize, decompose, exclusive_lengths

# Names as the PyTorch profiler reports them (shortened where the template tail does not matter).
NAMES = {
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
    "void gemvx::kernel<int, int, __nv_bfloat16, float, false, true, true, false, 7, false>": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "gemm",
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
    "kda_recurrent_step_kernel": "kda",
    "chunk_kda_fwd_kernel_o": "kda",
    "fused_recurrent_kda_fwd_kernel": "kda",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "kda",
    "mla_decode_attention_kernel": "mla_attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "mla_attention",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>": "mla_attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "mla_attention",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "moe_routing",
    "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>": "moe_routing",
    "moe_route_sigmoid_kernel": "moe_routing",
    "fused_moe_kernel": "moe_experts",
    "moe_expert_gemv_kernel": "moe_experts",  # an expert GEMV is expert time, not generic GEMM
    "rmsnorm_fwd_kernel": "norm",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>": "norm",
    "triton_poi_fused__to_copy_0": "cast",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda, "
    "memory::LoadWithCast<1>, memory::StoreWithCast<1>>": "cast",
    # PyTorch's dtype-converting copies and its dynamic-casting path for strided operands are casts ...
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda(float)#1}, std::array<char*, 2ul> >": "cast",
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16tofloat32_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >": "cast",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::"
    "{lambda(float)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>": "cast",
    # ... but its same-dtype paths (`nocast`, LoadWithoutCast) are not: a strided silu, mul or copy
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::(anonymous "
    "namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::operator()() "
    "const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)": "elementwise",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
    "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >("
    "at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, "
    "TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
    "at::native::memory::LoadWithoutCast, at::native::memory::StoreWithoutCast>": "elementwise",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}::operator()() "
    "const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)": "memcpy",
    "Memcpy DtoD (Device -> Device)": "memcpy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1>>": "memcpy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3>>":
        "elementwise",
    "void at::native::elementwise_kernel<128, 2, broadcast_lambda>": "elementwise",  # broadcast is not a cast
    "triton_poi_fused_add_mul_silu_3": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps<float, float>>>": "reduction",
    "triton_red_fused_sum_2": "reduction",
    "some_kernel_nobody_knows": "other",
    # cuDNN's fused SDPA, which torch's scaled_dot_product_attention ran for MLA's prefill (seen in e9f21488's trace)
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x192_4x1x1_cga1x1x1_kernel0_0":
        "mla_attention",
}


def test_every_kernel_of_ours_has_a_category():
    """Each Triton kernel in model/triton and benchmarks/candidates (whose kernels an A/B's trace shows), by the name
    the profiler reports (the function's), falls in a category
    other than `other`: a new kernel whose name no pattern knows would otherwise hide in `other` (until a review
    found them there: the prefill MoE's grouped GEMMs, 39% of the prefill in one A/B's trace, the MLA absorb, the
    dispatch and the SwiGLU kernel)."""
    import pathlib
    import re
    repo = pathlib.Path(__file__).resolve().parents[1]
    files = sorted((repo / "model" / "triton").glob("*.py")) + sorted((repo / "benchmarks" / "candidates").glob("*.py"))
    names = [n for f in files for n in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)]
    assert len(names) >= 20, names
    assert {n: categorize(n) for n in names if categorize(n) == "other"} == {}


@pytest.mark.parametrize("name,expected", list(NAMES.items()))
def test_categorize(name, expected):
    assert categorize(name) == expected


def test_categorize_rejects_non_string():
    with pytest.raises(TypeError, match="kernel name"):
        categorize(None)


def test_decompose_gaps_overlaps_and_unknown_names():
    # Two decode steps over 0..100 us; kda partly overlaps the first GEMV (another stream).
    # Kernel time: gemm 30+20, kda 20, unknown 20 = 90 us; busy union [0,40] u [50,70] u [80,100] = 80 us.
    events = [
        ("gemvx_kernel", 0, 30),
        ("kda_step", 20, 20),
        ("gemvx_kernel", 50, 20),
        ("mystery", 80, 20),
    ]
    d = decompose(events, steps=2)
    assert d["kernel_us"] == 90
    assert d["busy_us"] == 80
    assert d["wall_us"] == 100
    assert d["idle_fraction"] == pytest.approx(20 / 100)
    assert d["step_ms"] == pytest.approx(0.05)
    assert d["shares"]["gemm"] == pytest.approx(50 / 90)
    assert d["shares"]["kda"] == pytest.approx(20 / 90)
    assert d["shares"]["other"] == pytest.approx(20 / 90)
    assert set(d["shares"]) == set(CATEGORY_NAMES)
    assert math.fsum(d["shares"].values()) == pytest.approx(1.0)


def test_decompose_nested_and_unsorted_intervals():
    # A kernel wholly inside another, listed out of order: the union counts it once.
    events = [("b", 10, 5), ("a", 0, 40), ("c", 60, 40)]
    d = decompose(events, steps=1)
    assert d["busy_us"] == 80 and d["wall_us"] == 100
    assert d["idle_fraction"] == pytest.approx(0.2)


def test_decompose_no_gaps_is_zero_idle():
    d = decompose([("gemv", 0, 10), ("gemv", 10, 10)], steps=1)
    assert d["idle_fraction"] == 0


@pytest.mark.parametrize("events,steps,match", [
    ([], 1, "no kernel events"),
    ([("gemv", 0, 10)], 0, "steps"),
    ([("gemv", 0, -1)], 1, "negative"),
    ([("gemv", 0)], 1, "event 0"),
    ([("gemv", 0, 0)], 1, "zero duration"),
])
def test_decompose_rejects_bad_input(events, steps, match):
    with pytest.raises(ValueError, match=match):
        decompose(events, steps)


def test_exclusive_time_gives_an_early_launch_only_what_follows_the_kernel_it_overlaps():
    # b launched early (PDL) at 5 while a runs to 10, then b runs to 20: a keeps [0, 10], b gets [10, 20]
    d = decompose([("rmsnorm_kernel", 0, 10), ("moe_router_kernel", 5, 15)], steps=1)
    assert d["kernel_us"] == 25 and d["busy_us"] == 20
    assert d["shares"]["norm"] == pytest.approx(10 / 25) and d["shares"]["moe_routing"] == pytest.approx(15 / 25)
    assert d["exclusive_shares"]["norm"] == pytest.approx(0.5) and d["exclusive_shares"]["moe_routing"] == pytest.approx(0.5)
    assert math.fsum(d["exclusive_shares"].values()) == pytest.approx(1.0)


def test_exclusive_lengths_nested_tied_and_disjoint():
    assert exclusive_lengths([(10, 15), (0, 40)]) == [0.0, 40.0]            # inside another: nothing of its own
    assert exclusive_lengths([(0, 10), (0, 20)]) == [10.0, 10.0]            # same start: the one listed first
    assert exclusive_lengths([(0, 10), (20, 25), (25, 30)]) == [10.0, 5.0, 5.0]  # disjoint: their durations
    assert exclusive_lengths([(0, 0), (0, 5)]) == [0.0, 5.0]


def union_length(intervals):
    """The length of the union of [start, end) intervals, by merging them in order (the test's own oracle)."""
    total, cur = 0.0, None
    for start, end in sorted(intervals):
        if cur is None or start > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    return total + (0.0 if cur is None else cur[1] - cur[0])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30)), min_size=1, max_size=30))
def test_exclusive_lengths_partition_the_busy_time(spans):
    intervals = [(float(s), float(s + d)) for s, d in spans]
    excl = exclusive_lengths(intervals)
    assert math.fsum(excl) == pytest.approx(union_length(intervals))
    assert all(0 <= x <= e - s for x, (s, e) in zip(excl, intervals))
    starts = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], i))
    assert excl[starts[0]] == intervals[starts[0]][1] - intervals[starts[0]][0]  # the first to start loses nothing


def test_a_cpu_smoke_runs_matmul_operators_are_gemm():
    """On a CPU the decomposition's events are ATen's leaf operators: their matmuls are gemm (they read `other`,
    96.6% of a quick run), and nothing else ATen does is taken for one."""
    for name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::einsum", "aten::linear", "aten::matmul"):
        assert categorize(name) == "gemm", name
    for name in ("aten::add", "aten::mul", "aten::mm_backward_hypothetical", "aten::copy_"):
        assert categorize(name) != "gemm", name
