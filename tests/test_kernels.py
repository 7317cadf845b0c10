"""Block kernels against the fp64 reference, and the registry that picks them.

Tolerances: max abs error 1e-12 (fp64), 2e-6 (fp32) for out, lse and grads of O(1) values. Every
test here means the CPU unless its name says CUDA; the CUDA ones skip without a GPU.
"""
import importlib.util
import math

import pytest
import torch

from mcp_context.kernels import Capabilities, SizeDispatchKernel, finite_lse_for_backward, get_kernel, kernel_report
from mcp_context.kernels.math import MathKernel
from mcp_context.kernels.registry import refusal
from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
from tests.reference import full_attention

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
CPU = torch.device("cpu")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused CUDA ops)")


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


@pytest.mark.parametrize("backend", ["math", "torch", "torch:cpu_flash"])
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


def test_fused_cpu_kernel_reads_a_strided_last_dimension_exactly():
    """A q/k/v whose last dimension is not contiguous (a permuted view) is made dense before the aten op,
    which otherwise silently reads it as if it were (errors up to 2 were seen)."""
    q, k, v, do = _block(24, 24, 4, 2, 16, torch.float64)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _bhsd_reference(q, k, v, do, True, 0.25)
    strided = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v, do)]
    assert all(x.stride(-1) != 1 for x in strided)
    kernel = get_kernel("torch:cpu_flash", CPU, torch.float64)
    out, lse = kernel.forward(*strided[:3], True, 0.25)
    grads = kernel.backward(strided[3], *strided[:3], ref_out.transpose(-1, -2).contiguous().transpose(-1, -2),
                            ref_lse.squeeze(-1), True, 0.25)
    for got, ref in zip((out, lse) + tuple(grads), (ref_out, ref_lse.squeeze(-1), ref_dq, ref_dk, ref_dv)):
        assert (got - ref).abs().max().item() <= 1e-12


@pytest.mark.parametrize("backend", ["math", "torch"])
def test_backward_of_fully_masked_rows_is_zero_not_nan(backend):
    """Rows whose merged lse is -inf (nothing visible) contribute zero gradient, never NaN, once the
    executor has mapped -inf to +inf (``finite_lse_for_backward``, done once per backward)."""
    q, k, v, do = _block(8, 8, 2, 2, 8, torch.float32)
    q, k, v, do = (x.float() for x in (q, k, v, do))
    lse = finite_lse_for_backward(torch.full((1, 2, 8), float("-inf")))
    dq, dk, dv = get_kernel(backend, CPU, torch.float32).backward(do, q, k, v, torch.zeros_like(q), lse, True, 0.3)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and g.abs().max() == 0


def test_auto_picks_the_fused_cpu_op_and_unknown_backend_is_refused():
    assert get_kernel("auto", CPU, torch.float32).name == "torch:cpu_flash"
    with pytest.raises(ValueError, match=r"backend='cuda' is not known; choose one of auto, math, torch, "
                                         r"torch:cpu_flash, torch:cudnn, torch:flash, torch:efficient, te"):
        get_kernel("cuda", CPU, torch.float32)


def test_a_named_op_that_does_not_serve_is_refused_with_its_reason():
    with pytest.raises(ValueError, match=r"backend='torch:cudnn' does not serve torch.float32 on cpu here: runs on "
                                         r"cuda only, not cpu; use backend='auto'"):
        get_kernel("torch:cudnn", CPU, torch.float32)


class _Raising:
    """A kernel whose op raises the given exception type (as cuDNN's backward raised IndexError)."""

    name = "raising"
    capabilities = Capabilities(frozenset({"cpu"}), frozenset({torch.float32}), native_gqa=True)

    def __init__(self, exc):
        self.exc = exc

    def forward(self, *args, **kwargs):
        return MathKernel().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        raise self.exc("boom in the backward")


class _Wrong(MathKernel):
    """Off by 1 % in its forward output."""

    def forward(self, q, k, v, causal, scale, dropout=None):
        out, lse = super().forward(q, k, v, causal, scale)
        return out * 1.01, lse


@pytest.mark.parametrize("exc", [IndexError, KeyError, AssertionError, RuntimeError, ValueError])
def test_probe_treats_any_exception_as_does_not_serve_and_keeps_the_reason(exc):
    reason = refusal(_Raising(exc), CPU, torch.float32)
    assert reason is not None and reason.startswith(exc.__name__) and "boom in the backward" in reason


def test_probe_refuses_a_kernel_that_disagrees_with_math():
    reason = refusal(_Wrong(), CPU, torch.float32)
    assert reason is not None and "disagrees with the math kernel" in reason and "in out" in reason


def test_capabilities_filter_before_probing():
    caps = FUSED_OPS["cudnn"].capabilities
    assert caps.refusal(CPU, torch.bfloat16, False) == "runs on cuda only, not cpu"
    assert caps.refusal(torch.device("cuda"), torch.float32, False) == "supports bfloat16, float16 only, not float32"
    assert "dropout" in caps.refusal(torch.device("cuda"), torch.bfloat16, True)
    assert MathKernel.capabilities.refusal(CPU, torch.float16, True) is None


class _Recording:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []
        self.name, self.capabilities = kernel.name, kernel.capabilities

    def forward(self, q, *args):
        self.calls.append(("forward", q.shape[2]))
        return self.kernel.forward(q, *args)

    def backward(self, dout, q, *args):
        self.calls.append(("backward", q.shape[2]))
        return self.kernel.backward(dout, q, *args)


def test_size_dispatch_sends_small_blocks_to_one_kernel_and_large_to_the_other():
    small, large = _Recording(MathKernel()), _Recording(get_kernel("torch:cpu_flash", CPU, torch.float64))
    kernel = SizeDispatchKernel(small, large, max_small_rows=16)
    for n in (8, 16, 24):
        q, k, v, do = _block(n, n, 2, 1, 8, torch.float64)
        out, lse = kernel.forward(q, k, v, True, 0.3)
        kernel.backward(do, q, k, v, out, lse, True, 0.3)
    assert small.calls == [("forward", 8), ("backward", 8), ("forward", 16), ("backward", 16)]
    assert large.calls == [("forward", 24), ("backward", 24)]


def test_kernel_report_names_the_choice_and_every_refusal(capsys):
    from mcp_context.kernels.__main__ import main

    rep = kernel_report(CPU, torch.float32)
    assert rep["auto"] == "torch:cpu_flash" and rep["backends"]["math"] == "serves"
    assert rep["backends"]["torch:flash"] == "runs on cuda only, not cpu"
    assert main(["--head-dim", "32"]) == 0
    printed = capsys.readouterr().out
    assert "cpu float32: auto -> torch:cpu_flash" in printed and "torch:cudnn      runs on cuda only" in printed
    assert main(["--head-dim", "0"]) == 2


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient"])
def test_cuda_op_calls_match_their_schemas_on_meta_tensors(name):
    """Every CUDA aten call runs through torch's meta kernels: the argument lists match the schemas and
    GQA gradients come back with h_kv heads. (Only a GPU shows the values are right: see the CUDA tests.)"""
    kernel = TorchKernel(FUSED_OPS[name])
    q = torch.empty(1, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 24, 64, device="meta", dtype=torch.bfloat16)
    out, lse = kernel.forward(q, k, k, False, 0.125)
    assert out.shape == q.shape and lse.shape == (1, 4, 40) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(q, q, k, k, out, lse, False, 0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here; this checks the message given without it")
def test_te_backend_refuses_clearly_without_transformer_engine():
    with pytest.raises(RuntimeError, match=r"backend='te' needs Transformer Engine.*backend='auto'"):
        get_kernel("te", CPU, torch.float32)


@CUDA_ONLY
@pytest.mark.parametrize("backend", ["auto", "torch:cudnn", "torch:flash"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,sq,sk", [(True, 256, 256), (False, 256, 384), (True, 2048, 2048)])
def test_cuda_fused_kernel_matches_reference_in_half_precision(backend, dtype, causal, sq, sk):
    """The fused CUDA ops, GQA native (8 query / 2 KV heads), against fp64: max abs error <= 2e-2."""
    q, k, v, do = _block(sq, sk, 8, 2, 128, dtype)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _bhsd_reference(q, k, v, do, causal, 128 ** -0.5)
    kernel = get_kernel(backend, torch.device("cuda"), dtype, head_dim=128)
    assert kernel.name.startswith("torch:")
    args = [x.to("cuda", dtype) for x in (q, k, v)]
    out, lse = kernel.forward(*args, causal, 128 ** -0.5)
    grads = kernel.backward(do.to("cuda", dtype), *args, ref_out.to("cuda", dtype), ref_lse.squeeze(-1).cuda().float(),
                            causal, 128 ** -0.5)
    for got, ref in zip((out, lse) + tuple(grads), (ref_out, ref_lse.squeeze(-1), ref_dq, ref_dk, ref_dv)):
        assert got.shape == ref.shape
        assert (got.double().cpu() - ref).abs().max().item() <= 2e-2


@CUDA_ONLY
def test_cuda_auto_takes_cudnn_for_large_blocks_when_it_serves():
    rep = kernel_report(torch.device("cuda"), torch.bfloat16, 128)
    if rep["backends"]["torch:cudnn"] == "serves":
        assert rep["auto"].startswith("torch:cudnn")
    assert rep["backends"]["math"] == "serves"
    assert kernel_report(torch.device("cuda"), torch.float64, 128)["auto"] == "math"
