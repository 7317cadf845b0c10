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
