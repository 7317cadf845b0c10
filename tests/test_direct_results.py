"""A plan whose query rows each meet one block (a ring of one: ``a2a``, a group of one under dynamic CP,
disjoint documents) returns the fused op's own results: out, dq, dk and dv bit for bit what the op gives
called alone on the same rows, where the accumulators would have added an fp32 round trip and copies.

On the CPU op (``torch:cpu_flash``), bf16 and fp32, [s, b, h, d] inputs, GQA 4/2 heads; the op counts of the
same path on fake CUDA tensors are pinned in tests/test_step_ops.py.
"""
from __future__ import annotations

import pytest
import torch

from mcp_context.algorithms.executor import RingAttention, RingPlan
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
from mcp_context.masks import CAUSAL_BLOCK
from mcp_context.schedule import BlockTask

S, B, H, H_KV, D = 64, 1, 4, 2, 16


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, H, D, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(S, B, H_KV, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(S, B, H, D, generator=g).to(dtype)


def _alone(q, k, v, dout, rows):
    """The fused op on rows ``rows`` of every input, causal, as a user would call it."""
    part = [x.detach()[rows[0]:rows[1]].permute(1, 2, 0, 3).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)
    out.backward(dout[rows[0]:rows[1]].permute(1, 2, 0, 3))
    return [x.permute(2, 0, 1, 3) for x in (out.detach(), *(p.grad for p in part))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("runs", [[(0, S)], [(0, 24), (24, S)]], ids=["one-call", "two-documents"])
def test_a_plan_without_merges_returns_the_fused_ops_results_bit_for_bit(dtype, runs):
    q, k, v, dout = _inputs(dtype)
    kernel = cpu_flash_kernel()
    plan = RingPlan.build([[BlockTask(r, r, CAUSAL_BLOCK) for r in runs]], LocalRotation(0, 1), kernel, D ** -0.5, S)
    assert not plan.merges
    out, lse = RingAttention.apply(q, k, v, plan)
    out.backward(dout)
    assert out.dtype == q.grad.dtype == k.grad.dtype == dtype and out.is_contiguous() and q.grad.is_contiguous()
    for rows in runs:
        want = _alone(q, k, v, dout, rows)
        got = [x[rows[0]:rows[1]] for x in (out, q.grad, k.grad, v.grad)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), (name, rows, (a.float() - b.float()).abs().max().item())


def _cudnn_alone(q, k, v, dout, rows):
    """cuDNN's aten op pair called by hand on rows ``rows`` (the schema FIELD_NOTES records), causal."""
    aten = torch.ops.aten
    qb, kb, vb, db = (x.detach()[rows[0]:rows[1]].permute(1, 2, 0, 3) for x in (q, k, v, dout))
    n = rows[1] - rows[0]
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(qb, kb, vb, None, True, 0.0, True, False, scale=D ** -0.5)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(db, qb, kb, vb, out, lse, zero, zero, None, None,
                                                                   None, n, n, 0.0, True, scale=D ** -0.5)
    return [x.permute(2, 0, 1, 3) for x in (out, dq, dk, dv)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's fused op)")
@pytest.mark.parametrize("runs", [[(0, S)], [(0, 24), (24, S)]], ids=["one-call", "two-documents"])
def test_on_cuda_a_plan_without_merges_returns_cudnns_results_bit_for_bit(runs):
    """The same on an NVIDIA GPU with ``torch:cudnn``, bf16 (passes on an H200, 2026-11-26, since a call
    whose outputs are the results enters no side stream). The one-call plan's out is cuDNN's own output, token-major as cuDNN lays it out for
    token-major inputs: no copy between the op and the caller."""
    from mcp_context.algorithms.executor import ring_backward, ring_forward
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from tools.step_ops import counting

    q, k, v, dout = (x.detach().cuda().requires_grad_(x.requires_grad) for x in _inputs(torch.bfloat16))
    plan = RingPlan.build([[BlockTask(r, r, CAUSAL_BLOCK) for r in runs]], LocalRotation(0, 1),
                          TorchKernel(FUSED_OPS["cudnn"]), D ** -0.5, S)
    out, _ = RingAttention.apply(q, k, v, plan)
    out.backward(dout)
    assert out.is_contiguous() and q.grad.is_contiguous()
    if len(runs) == 1:  # nothing runs around the op but the backward's finite lse (tools/step_ops.py counts)
        with counting() as forward:
            o, lse = ring_forward(q.detach(), k.detach(), v.detach(), plan)
        with counting() as backward:
            ring_backward(dout, q.detach(), k.detach(), v.detach(), o, lse, plan)
        assert forward.tally.ops == 0 and dict(backward.tally.by_op) == {"nan_to_num": 1}, (
            forward.tally.by_op, backward.tally.by_op)
    for rows in runs:
        want = _cudnn_alone(q, k, v, dout, rows)
        got = [x[rows[0]:rows[1]] for x in (out, q.grad, k.grad, v.grad)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), (name, rows, (a.float() - b.float()).abs().max().item())
