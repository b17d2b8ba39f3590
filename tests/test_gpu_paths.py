"""The fast path at the 48B model's real shapes (4 layers: KDA, KDA, KDA, MLA; 256 experts, top-8) on CUDA.

fp32: the CUDA-graph incremental path must equal a fresh recompute (relative error 1e-4: a state-carry or
kernel bug shows as O(1)). bf16: decode and recompute legitimately round differently, so the test holds the
decode path's deviation against a noise floor measured on the same model: the same prefix prefilled in two
chunks instead of one (same kernels, other GEMM shapes). The decode path may not add more than that.
Packed KDA projections: equal to the separate nn.Linears they replace (fp32), in fewer launches.
"""
import functools

import pytest
import torch

from model import ops
from model.build import from_state_dict
from model.config import PRESETS
from model.generate import generate_incremental, generate_recompute
from model.weights import synthetic_weights
from tests.conftest import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = PRESETS["48b-a3b"].replace(name="48b-a3b-4layers", num_hidden_layers=4, kda_layers=(1, 2, 3),
                                 full_attn_layers=(4,))
PROMPTS = [list(range(1000, 1097)), [163584] + list(range(5, 300, 7))]


def model(dtype):
    return from_state_dict(CFG, synthetic_weights(CFG, seed=0, device="cuda", dtype=dtype))


def test_graph_decode_equals_recompute_fp32_real_shapes():
    m = model(torch.float32)
    with ops.use("auto"):
        for prompt in PROMPTS:
            inc = generate_incremental(m, prompt, 8, keep_logits=True)
            rec = generate_recompute(m, prompt, 8, keep_logits=True)
            assert inc.decoder == "GraphDecoder"
            errs = [rel_err(a, b) for a, b in zip(inc.logits, rec.logits)]
            assert inc.tokens == rec.tokens, errs
            assert max(errs) < 1e-4, errs
    del m
    torch.cuda.empty_cache()


def test_bf16_decode_adds_no_more_error_than_a_change_of_gemm_shape():
    m = model(torch.bfloat16)
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    T = ids.shape[1]
    ref = m(ids, last_only=True)                                   # recompute: the whole sequence at once
    c2 = m.new_cache(1, T)
    m.prefill(ids[:, :60], c2)
    chunked = m.prefill(ids[:, 60:], c2)                           # same tokens, prefilled in two chunks
    c3 = m.new_cache(1, T)
    m.prefill(ids[:, :-1], c3)
    decoded = m.decode_step(ids[:, -1], c3)                        # the last token through the decode step
    floor, err = rel_err(chunked, ref), rel_err(decoded, ref)
    print(f"bf16 last-token logits vs recompute: chunked prefill {floor:.2e}, decode step {err:.2e}")
    assert err < max(3 * floor, 1e-3), (err, floor)


def cuda_kernels(fn) -> int:
    """How many kernels (and memcpy/memset) `fn` puts on the GPU, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def test_packed_kda_projections_fp32_real_shapes():
    """The packed KDA projections (one GEMV and one batched GEMV per layer, tests/test_pack.py) against the
    separate nn.Linears they replace, fp32 at real shapes: the packed graph decode equals the unpacked one and a
    fresh recompute, and an eager decode step launches at least 6 fewer kernels per KDA layer."""
    from tests.test_pack import unpacked

    m = model(torch.float32)
    prompt = PROMPTS[0]
    with ops.use("auto"):
        inc = generate_incremental(m, prompt, 8, keep_logits=True)
        rec = generate_recompute(m, prompt, 8, keep_logits=True)
        with unpacked():
            ref = generate_incremental(m, prompt, 8, keep_logits=True)
        assert inc.decoder == ref.decoder == "GraphDecoder"
        assert inc.tokens == rec.tokens == ref.tokens
        errs = [(rel_err(a, b), rel_err(a, c)) for a, b, c in zip(inc.logits, ref.logits, rec.logits)]
        assert max(max(e) for e in errs) < 1e-4, errs

        ids = torch.tensor([prompt], device="cuda")
        counts = {}
        for name, ctx in (("packed", torch.no_grad()), ("unpacked", unpacked())):
            with ctx:
                cache = m.new_cache(1, len(prompt) + 4)
                m.prefill(ids, cache)
                tok = ids[:, -1]
                m.decode_step(tok, cache)                                  # warm-up: Triton compile, cuBLAS setup
                counts[name] = cuda_kernels(functools.partial(m.decode_step, tok, cache))
        n_kda = len(CFG.kda_layer_ids)
        print(f"kernels per decode step: {counts} ({n_kda} KDA layers)")
        assert counts["packed"] <= counts["unpacked"] - 6 * n_kda, counts
    del m
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_prefill_attention_without_padding_v_gives_the_padded_forms_bits(dtype):
    """A prefill from an empty cache hands v [.., 128] to cuDNN's flash kernel unpadded; the padded form (v zero-
    padded to q's 192 columns, as torch's flash kernel needs) must give the same bits. With a cache (T < S) the
    padded form runs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, S = 1, 8, 1024
    q, k = (torch.randn(B, H, S, 192, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(B, H, S, 128, device="cuda", dtype=dtype, generator=g)
    o = ops.mla_prefill_attention(q, k, v, 0.07)
    assert ops._cudnn_narrow_v is True  # the H200 image's cuDNN takes the narrower v
    padded = torch.nn.functional.scaled_dot_product_attention(
        q, k, torch.nn.functional.pad(v, (0, 64)), is_causal=True, scale=0.07)[..., :128]
    assert o.shape == (B, H, S, 128) and torch.equal(o, padded)
    tail = ops.mla_prefill_attention(q[:, :, -100:], k, v, 0.07)  # 100 new queries over the whole cache
    assert rel_err(tail.float(), o[:, :, -100:].float()) < 1e-2  # other kernels: close, not the same bits
