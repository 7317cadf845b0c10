"""Block kernels (math, fused torch) against the fp64 reference, forward and backward.

Tolerances: max abs error 1e-12 (fp64), 2e-6 (fp32) for out, lse and grads of O(1) values.
"""
import math

import pytest
import torch

from mcp_context.kernels import get_kernel
from tests.reference import full_attention

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
CPU = torch.device("cpu")


def _block(sq, sk, h, h_kv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(1, h, sq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, h_kv, sk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, do


def _bhsd_reference(q, k, v, do, causal, scale):
    leaves = [x.permute(2, 0, 1, 3).clone().requires_grad_() for x in (q, k, v)]  # -> sbhd
    out, lse = full_attention(*leaves, causal, scale)
    out.backward(do.permute(2, 0, 1, 3))
    back = [out.detach(), lse.unsqueeze(-1)] + [x.grad for x in leaves]
    return [x.permute(1, 2, 0, 3) for x in back]  # -> bhsd (lse as [b, h, s, 1])


@pytest.mark.parametrize("backend", ["math", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal,sq,sk,h_kv", [(True, 24, 24, 2), (False, 24, 40, 1), (False, 17, 9, 4),
                                              (True, 33, 33, 4)])
def test_kernel_matches_fp64_reference(backend, dtype, causal, sq, sk, h_kv):
    q, k, v, do = _block(sq, sk, 4, h_kv, 16, dtype)
    scale = 1 / math.sqrt(16)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _bhsd_reference(q, k, v, do, causal, scale)
    kernel = get_kernel(backend, CPU, dtype)
    args = [x.to(dtype) for x in (q, k, v)]
    out, lse = kernel.forward(*args, causal, scale)
    dq, dk, dv = kernel.backward(do.to(dtype), *args, ref_out, ref_lse.squeeze(-1), causal, scale)
    for name, got, ref in [("out", out, ref_out), ("lse", lse, ref_lse.squeeze(-1)), ("dq", dq, ref_dq),
                           ("dk", dk, ref_dk), ("dv", dv, ref_dv)]:
        err = (got.double() - ref).abs().max().item()
        assert err <= TOL[dtype], f"{backend} {name}: {err:.2e}"


@pytest.mark.parametrize("backend", ["math", "torch"])
def test_backward_of_fully_masked_rows_is_zero_not_nan(backend):
    """Rows whose merged lse is -inf (nothing visible) contribute zero gradient, never NaN."""
    q, k, v, do = _block(8, 8, 2, 2, 8, torch.float32)
    q, k, v, do = (x.float() for x in (q, k, v, do))
    lse = torch.full((1, 2, 8), float("-inf"))
    dq, dk, dv = get_kernel(backend, CPU, torch.float32).backward(do, q, k, v, torch.zeros_like(q), lse, True, 0.3)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and g.abs().max() == 0


def test_auto_picks_the_fused_cpu_op_and_unknown_backend_is_refused():
    assert get_kernel("auto", CPU, torch.float32).name == "torch:cpu_flash"
    with pytest.raises(ValueError, match=r"backend='cuda' is not known; choose one of auto, math, torch, te"):
        get_kernel("cuda", CPU, torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="TE may be importable on a CUDA machine")
def test_te_backend_refuses_clearly_without_transformer_engine():
    with pytest.raises(RuntimeError, match=r"backend='te' needs Transformer Engine.*backend='auto'"):
        get_kernel("te", CPU, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused CUDA ops)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_fused_kernel_matches_reference_in_half_precision(dtype):
    q, k, v, do = _block(256, 256, 8, 2, 64, dtype)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _bhsd_reference(q, k, v, do, True, 0.125)
    kernel = get_kernel("auto", torch.device("cuda"), dtype)
    assert kernel.name.startswith("torch:")
    args = [x.to("cuda", dtype) for x in (q, k, v)]
    out, lse = kernel.forward(*args, True, 0.125)
    grads = kernel.backward(do.to("cuda", dtype), *args, ref_out.cuda(), ref_lse.squeeze(-1).cuda(), True, 0.125)
    for got, ref in zip((out, lse) + tuple(grads), (ref_out, ref_lse.squeeze(-1), ref_dq, ref_dk, ref_dv)):
        assert (got.double().cpu() - ref).abs().max().item() <= 2e-2
