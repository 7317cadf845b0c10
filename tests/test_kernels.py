"""Block kernels against the fp64 reference, and the registry that picks them.

Tolerances: max abs error 1e-12 (fp64), 2e-6 (fp32) for out, lse and grads of O(1) values. Half
precision (the CUDA tests): ``HALF_ULPS`` units of the dtype's rounding (2^-8 bf16, 2^-11 fp16) times
the reference's largest magnitude, the reference computed in fp64 from the same rounded inputs (see
``half_tolerance``). Every test here means the CPU unless its name says CUDA; the CUDA ones skip
without a GPU; the fake-CUDA ones run the CUDA ops' shape functions under ``FakeTensorMode``.
"""
import importlib.util
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from mcp_context.kernels import Capabilities, SizeDispatchKernel, finite_lse_for_backward, get_kernel, kernel_report
from mcp_context.kernels.math import MathKernel
from mcp_context.kernels.registry import NOT_PROBED, FallbackKernel, probe, refusal
from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
from mcp_context.masks import CAUSAL_BLOCK, FULL_BLOCK
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
    mask = CAUSAL_BLOCK if causal else FULL_BLOCK
    out, lse = kernel.forward(*args, mask, scale)
    dq, dk, dv = kernel.backward(do.to(dtype), *args, ref_out, ref_lse.squeeze(-1), mask, scale)
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
    out, lse = kernel.forward(*strided[:3], CAUSAL_BLOCK, 0.25)
    grads = kernel.backward(strided[3], *strided[:3], ref_out.transpose(-1, -2).contiguous().transpose(-1, -2),
                            ref_lse.squeeze(-1), CAUSAL_BLOCK, 0.25)
    for got, ref in zip((out, lse) + tuple(grads), (ref_out, ref_lse.squeeze(-1), ref_dq, ref_dk, ref_dv)):
        assert (got - ref).abs().max().item() <= 1e-12


@pytest.mark.parametrize("backend", ["math", "torch"])
def test_backward_of_fully_masked_rows_is_zero_not_nan(backend):
    """Rows whose merged lse is -inf (nothing visible) contribute zero gradient, never NaN, once the
    executor has mapped -inf to +inf (``finite_lse_for_backward``, done once per backward)."""
    q, k, v, do = _block(8, 8, 2, 2, 8, torch.float32)
    q, k, v, do = (x.float() for x in (q, k, v, do))
    lse = finite_lse_for_backward(torch.full((1, 2, 8), float("-inf")))
    dq, dk, dv = get_kernel(backend, CPU, torch.float32).backward(do, q, k, v, torch.zeros_like(q), lse, CAUSAL_BLOCK, 0.3)
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
        out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, 0.3)
        kernel.backward(do, q, k, v, out, lse, CAUSAL_BLOCK, 0.3)
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
    out, lse = kernel.forward(q, k, k, FULL_BLOCK, 0.125)
    assert out.shape == q.shape and lse.shape == (1, 4, 40) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(q, q, k, k, out, lse, FULL_BLOCK, 0.125)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here; this checks the message given without it")
def test_te_backend_refuses_clearly_without_transformer_engine():
    with pytest.raises(RuntimeError, match=r"backend='te' needs Transformer Engine.*backend='auto'"):
        get_kernel("te", CPU, torch.float32)


# Half precision, by construction: the kernel sees the inputs rounded to the dtype and the fp64
# reference is computed from those same rounded values, so only the kernel's own rounding is measured.
# Rounding the output to the dtype alone is up to u = 2^-8 (bf16) or 2^-11 (fp16) relative, so any
# fixed absolute bound fails once values exceed 1/(u/abs_tol) (dq and dk at d=128 reach ~10). The fused
# ops also round the probabilities and dS to the dtype before their second matmuls (each term off by
# <= u relative, weighted by probabilities that sum to 1: <= u * max|v| or u * max|ds| * max|q| in all),
# accumulate in fp32 (~d * 2^-24, negligible) and are given the merged out rounded once more. Each adds
# at most about u times the reference's magnitude; HALF_ULPS = 8 covers them with room, and does not
# grow with the block size.
HALF_ULPS = 8
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def half_tolerance(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Max abs error allowed for a half-precision kernel result whose fp64 reference is ``ref``."""
    return HALF_ULPS * UNIT_ROUNDOFF[dtype] * max(1.0, ref.abs().max().item())


@CUDA_ONLY
@pytest.mark.parametrize("backend", ["auto", "torch:cudnn", "torch:flash"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,sq,sk", [(True, 256, 256), (False, 256, 384), (True, 2048, 2048)])
def test_cuda_fused_kernel_matches_reference_in_half_precision(backend, dtype, causal, sq, sk):
    """The fused CUDA ops, GQA native (8 query / 2 KV heads), against fp64 of the same rounded inputs:
    max abs error <= ``half_tolerance`` (8 units of rounding times the reference's magnitude)."""
    q, k, v, do = (x.to(dtype).double() for x in _block(sq, sk, 8, 2, 128, dtype))
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _bhsd_reference(q, k, v, do, causal, 128 ** -0.5)
    kernel = get_kernel(backend, torch.device("cuda"), dtype, head_dim=128)
    assert kernel.name.startswith("torch:")
    args = [x.to("cuda", dtype) for x in (q, k, v)]
    mask = CAUSAL_BLOCK if causal else FULL_BLOCK
    out, lse = kernel.forward(*args, mask, 128 ** -0.5)
    grads = kernel.backward(do.to("cuda", dtype), *args, ref_out.to("cuda", dtype), ref_lse.squeeze(-1).cuda().float(),
                            mask, 128 ** -0.5)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads),
                              (ref_out, ref_lse.squeeze(-1), ref_dq, ref_dk, ref_dv)):
        assert got.shape == ref.shape
        err, tol = (got.double().cpu() - ref).abs().max().item(), half_tolerance(dtype, ref)
        assert err <= tol, f"{backend} {dtype} {name}: {err:.3e} > {tol:.3e}"


@CUDA_ONLY
def test_cuda_auto_takes_cudnn_for_large_blocks_when_it_serves():
    rep = kernel_report(torch.device("cuda"), torch.bfloat16, 128)
    if rep["backends"]["torch:cudnn"] == "serves":
        assert rep["auto"].startswith("torch:cudnn")
    assert rep["backends"]["math"] == "serves"
    assert kernel_report(torch.device("cuda"), torch.float64, 128)["auto"] == "math"


class _RecordOp(TorchDispatchMode):
    """Records the arguments one aten op is called with (observes; every call still runs)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def test_efficient_backward_is_handed_bshd_packed_out_and_dout():
    """The efficient op's backward reads ``out`` (and ``dout``) with a row stride of ``h * d``: given the
    executor's ``[b, h, s, d]`` views (b = 2) it must receive them packed as ``[b, s, h, d]``, or its
    half-precision dq/dk are wrong and it reads past the end of ``out``."""
    kernel = TorchKernel(FUSED_OPS["efficient"])
    q = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, 24, 64, device="meta", dtype=torch.bfloat16)
    out = torch.empty(40, 2, 4, 64, device="meta", dtype=torch.bfloat16).permute(1, 2, 0, 3)  # sbhd storage
    lse = torch.empty(2, 4, 40, device="meta", dtype=torch.float32)
    record = _RecordOp(torch.ops.aten._scaled_dot_product_efficient_attention_backward.default)
    with record:
        kernel.backward(out, q, k, k, out, lse, FULL_BLOCK, 0.125)
    (args,) = record.calls
    dout_arg, out_arg = args[0], args[5]
    for name, x in (("dout", dout_arg), ("out", out_arg)):
        assert x.shape == (2, 4, 40, 64) and x.transpose(1, 2).is_contiguous(), f"{name} strides {x.stride()}"


class _RaisesOverRows(MathKernel):
    """An op that raises on blocks of more than ``rows`` query rows (as a fused op may on a shape no probe
    tried), and counts its calls."""

    name = "test:raises_over_rows"

    def __init__(self, rows):
        self.rows, self.calls = rows, 0

    def forward(self, q, k, v, mask, scale, dropout=None):
        self.calls += 1
        if q.shape[2] > self.rows:
            raise RuntimeError(f"no kernel for {q.shape[2]} rows")
        return super().forward(q, k, v, mask, scale, dropout)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout=None):
        self.calls += 1
        if q.shape[2] > self.rows:
            raise IndexError(f"backward has no kernel for {q.shape[2]} rows")
        return super().backward(dout, q, k, v, out, lse, mask, scale, dropout)


def test_a_block_shape_an_op_raises_on_falls_back_to_the_next_op_once_and_loudly():
    raising, math_kernel = _RaisesOverRows(16), MathKernel()
    kernel = FallbackKernel([raising, math_kernel])
    small, large = _block(16, 16, 2, 1, 8, torch.float64), _block(24, 24, 2, 1, 8, torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # the same two shapes, as every step of a schedule sends them
            for q, k, v, do in (small, large):
                out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, 0.3)
                grads = kernel.backward(do, q, k, v, out, lse, CAUSAL_BLOCK, 0.3)
                ref = math_kernel.forward(q, k, v, CAUSAL_BLOCK, 0.3)
                ref_grads = math_kernel.backward(do, q, k, v, ref[0], ref[1], CAUSAL_BLOCK, 0.3)
                for got, want in zip((out, lse) + tuple(grads), tuple(ref) + tuple(ref_grads)):
                    assert (got - want).abs().max().item() <= 1e-12
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "test:raises_over_rows failed on a causal block q[1, 2, 24, 8]" in messages[0]
    assert "RuntimeError: no kernel for 24 rows" in messages[0] and "goes to math from now on" in messages[0]
    (reasons,) = kernel.failures.values()
    assert reasons == {"test:raises_over_rows": "RuntimeError: no kernel for 24 rows"}
    assert raising.calls == 3 * 2 + 1  # small blocks every time, the large shape only once


def test_the_last_kernel_of_a_fallback_chain_raises_as_it_is():
    kernel = FallbackKernel([_RaisesOverRows(4), _RaisesOverRows(8)])
    q, k, v, _ = _block(12, 12, 2, 1, 8, torch.float64)
    with warnings.catch_warnings(record=True), pytest.raises(RuntimeError, match="no kernel for 12 rows"):
        warnings.simplefilter("always")
        kernel.forward(q, k, v, CAUSAL_BLOCK, 0.3)


def test_auto_on_cpu_falls_back_from_the_fused_op_to_math():
    kernel = get_kernel("auto", CPU, torch.float32)
    assert isinstance(kernel, FallbackKernel) and [k.name for k in kernel.kernels] == ["torch:cpu_flash", "math"]


class _FirstBatchOnly(MathKernel):
    """Right for b = 1 only: every batch entry gets the first entry's result (a wrong batch stride)."""

    def forward(self, q, k, v, mask, scale, dropout=None):
        out, lse = super().forward(q, k, v, mask, scale, dropout)
        return out[:1].expand_as(out), lse[:1].expand_as(lse)


class _IgnoresStrides(MathKernel):
    """Reads its inputs as if they were packed ``[b, h, s, d]`` (as a kernel that trusts no strides)."""

    def forward(self, q, k, v, mask, scale, dropout=None):
        packed = [torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset()) for x in (q, k, v)]
        return super().forward(*packed, mask, scale, dropout)


@pytest.mark.parametrize("kernel,what", [(_FirstBatchOnly(), "b=2"), (_IgnoresStrides(), "in out")])
def test_probe_sends_the_shapes_a_schedule_sends_batches_and_strided_views_at_row_offsets(kernel, what):
    reason = refusal(kernel, CPU, torch.float32)
    assert reason is not None and "disagrees with the math kernel" in reason and what in reason


def test_dropout_on_cuda_is_refused_where_the_math_kernels_scores_exceed_the_bound(monkeypatch):
    """Dropout sends every block to the math kernel; its fp32 scores for a 16K-row shard of 32 heads take
    32 GiB. The error names the parameter, the value and the fix; the bound is an env var."""
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"dropout_p=0\.1; Megatron's attention_dropout, --attention-dropout.*32\.0 "
                                         r"GiB on CUDA, over the 2 GiB bound.*--attention-dropout 0 \(dropout_p=0\.0\)"):
        get_kernel("auto", cuda, torch.bfloat16, dropout=0.1, rows=16384, heads=32)
    assert get_kernel("auto", cuda, torch.bfloat16, dropout=0.1, rows=4096, heads=32).name == "math"  # 2.0 GiB
    assert get_kernel("auto", CPU, torch.float32, dropout=0.1, rows=16384, heads=32).name == "math"  # host memory
    monkeypatch.setenv("MCP_CONTEXT_MATH_SCORES_MAX_GIB", "64")
    assert get_kernel("auto", cuda, torch.bfloat16, dropout=0.1, rows=16384, heads=32).name == "math"
    monkeypatch.setenv("MCP_CONTEXT_MATH_SCORES_MAX_GIB", "lots")
    with pytest.raises(ValueError, match=r"MCP_CONTEXT_MATH_SCORES_MAX_GIB='lots' must be a positive number"):
        get_kernel("auto", cuda, torch.bfloat16, dropout=0.1, rows=16384, heads=32)


def test_a_rehearsal_trusts_declared_capabilities_and_says_it_did_not_probe():
    """Under FakeTensorMode no numbers exist: the CUDA ops are chosen from their declarations, the report
    says so, and the verdicts are kept apart from real ones."""
    cuda = torch.device("cuda")
    with FakeTensorMode():
        kernel = get_kernel("torch:cudnn", cuda, torch.bfloat16, head_dim=128)
        rep = kernel_report(cuda, torch.bfloat16, 128)
        assert probe("torch:cudnn", cuda, torch.float32).reason == "supports bfloat16, float16 only, not float32"
    assert kernel.name == "torch:cudnn"
    assert rep["backends"]["torch:cudnn"] == f"serves ({NOT_PROBED})" and rep["backends"]["math"] == "serves"
    assert rep["auto"] == "torch:cudnn+flash<=1024"
    if not torch.cuda.is_available():
        assert probe("torch:cudnn", cuda, torch.bfloat16, head_dim=128).kernel is None  # really probed: no CUDA


# MLA: a value head dim other than the query/key one (dqk=24, dv=16 here; DeepSeek-V3: 192/128).
def _mla_reference(q, k, v, do, causal, scale):
    """fp64 attention written out: ``q, k [b, h(_kv), s, dqk]``, ``v [b, h_kv, s, dv]`` -> out, lse, grads."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(g, dim=1) for x in leaves[1:])
    s = leaves[0] @ kk.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ vv
    out.backward(do)
    return [out.detach(), lse.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal,sq,sk", [(True, 20, 20), (False, 20, 12)])
def test_kernels_with_a_distinct_value_head_dim_match_fp64_reference(dtype, causal, sq, sk):
    gen = torch.Generator().manual_seed(1)
    q, do = torch.randn(2, 4, sq, 24, generator=gen, dtype=torch.float64), torch.randn(2, 4, sq, 16, generator=gen,
                                                                                        dtype=torch.float64)
    k, v = torch.randn(2, 2, sk, 24, generator=gen, dtype=torch.float64), torch.randn(2, 2, sk, 16, generator=gen,
                                                                                       dtype=torch.float64)
    ref = _mla_reference(q, k, v, do, causal, 0.2)
    kernel = get_kernel("auto", CPU, dtype, head_dim=24, v_head_dim=16)
    assert kernel.name == "math"  # the CPU fused op refuses dv != dqk
    args = [x.to(dtype) for x in (q, k, v)]
    mask = CAUSAL_BLOCK if causal else FULL_BLOCK
    out, lse = kernel.forward(*args, mask, 0.2)
    grads = kernel.backward(do.to(dtype), *args, ref[0].to(dtype), ref[1].to(dtype), mask, 0.2)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads), ref):
        assert got.shape == want.shape, name
        err = (got.double() - want).abs().max().item()
        assert err <= TOL[dtype], f"{dtype} {name}: {err:.2e}"


def test_ops_that_do_not_take_a_distinct_value_head_dim_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"backend='torch:cpu_flash' does not serve torch.float32 on cpu with "
                                         r"head_dim=24, v_head_dim=16 here: needs the value head dim equal"):
        get_kernel("torch:cpu_flash", CPU, torch.float32, head_dim=24, v_head_dim=16)
    assert "Q/K/V should have the same head size" in _cpu_op_error_for_distinct_v_dim()
    cuda = torch.device("cuda")
    with FakeTensorMode():
        rep = kernel_report(cuda, torch.bfloat16, 192, 128)
    assert rep["backends"]["torch:cudnn"] == f"serves ({NOT_PROBED})"
    for name in ("torch:flash", "torch:efficient"):
        assert rep["backends"][name].startswith("needs the value head dim equal")
    assert rep["auto"] == "torch:cudnn"


def _cpu_op_error_for_distinct_v_dim() -> str:
    """What the CPU fused op says to dv != dqk (the fact its declaration records)."""
    q, k, v = torch.zeros(1, 2, 8, 24), torch.zeros(1, 2, 8, 24), torch.zeros(1, 2, 8, 16)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=0.2)
    except RuntimeError as err:
        return str(err)
    return "accepted"


def test_cudnn_takes_mla_head_dims_under_fake_cuda_forward_and_backward():
    """DeepSeek-V3's dqk=192, dv=128 through the cuDNN calls' shape functions: out and dV have dv columns."""
    with FakeTensorMode():
        kernel = get_kernel("torch:cudnn", torch.device("cuda"), torch.bfloat16, head_dim=192, v_head_dim=128)
        q = torch.empty(2, 8, 64, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, 64, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(2, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = kernel.forward(q, k, v, CAUSAL_BLOCK, 0.07)
        dq, dk, dv = kernel.backward(out, q, k, v, out, lse, CAUSAL_BLOCK, 0.07)
    assert out.shape == (2, 8, 64, 128) and lse.shape == (2, 8, 64)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
