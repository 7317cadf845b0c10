"""Each ring member's schedule run on one device, the other members' K/V laid out locally.

This is how a multi-rank schedule is checked on one GPU (NCCL refuses two ranks on one GPU and gloo
cannot send CUDA tensors): member ``m`` of a ring of ``P / inner`` runs its tasks through
``LocalRotation(m, ring)`` over every member's K/V shard; the dK/dV of all members are summed. A flat
ring is ``inner = 1``; ``inner = 2`` is one all-to-all rank of an ``a2a+p2p`` member (its heads: the
first ``h / 2`` query heads and their KV heads, replicated when ``h_kv < 2``).

Compared with an independent fp64 full attention over the same heads: out, lse, dq, dk, dv.
CPU (always): fp64 within 1e-10 and fp32 within 1e-5. CUDA (skipped without a GPU): bf16 and fp16,
every error at most 1.5x the error of one fused kernel call over the whole sequence in that dtype.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from mcp_context.algorithms.executor import RingAttention, RingPlan
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels import get_kernel
from mcp_context.layouts import spans_positions
from mcp_context.schedule import layout_schedule
from tests.reference import full_attention, random_qkv

HEADS, HEAD_DIM = 8, 16
LAYOUTS = ("zigzag", "contiguous", "striped")


def _heads(inner: int, kv_heads: int) -> tuple[slice, slice]:
    """Query and KV heads that all-to-all rank 0 of a group of ``inner`` holds (with fewer KV heads than
    ranks each KV head is replicated, so rank 0 holds KV head 0)."""
    return slice(0, HEADS // inner), slice(0, max(1, kv_heads // inner))


def run_members(layout, cp, inner, causal, kv_heads, dtype, device, seq_len, head_group=None, seed=0):
    """Every member's out/lse/dq and the summed dK/dV, next to the fp64 reference of the same heads.

    ``head_group``: the all-to-all degree whose rank-0 heads are used (default ``inner``)."""
    q, k, v, dout = random_qkv(seq_len, 1, HEADS, kv_heads, HEAD_DIM, seed=seed)
    q_heads, kv_idx = _heads(head_group or inner, kv_heads)
    q, dout = q[:, :, q_heads], dout[:, :, q_heads]
    k, v = k[:, :, kv_idx], v[:, :, kv_idx]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_leaves, causal, HEAD_DIM ** -0.5)
    ref_out.backward(dout)

    schedule = layout_schedule(layout, cp, seq_len, causal, inner)
    ring = schedule.ring_size
    positions = [spans_positions(spans) for spans in schedule.member_spans]
    order = torch.cat(positions)  # K/V rows in member order
    k_all, v_all = (x[order].to(device, dtype).requires_grad_() for x in (k, v))
    kernel = get_kernel("auto", torch.device(device), dtype, head_dim=HEAD_DIM)
    got = {"out": [], "lse": [], "dq": []}
    for member in range(ring):
        rows = positions[member]
        qm = q[rows].to(device, dtype).requires_grad_()
        plan = RingPlan.build(schedule.tasks[member], LocalRotation(member, ring), kernel, HEAD_DIM ** -0.5, len(rows))
        out, lse = RingAttention.apply(qm, k_all, v_all, plan)
        out.backward(dout[rows].to(device, dtype))
        got["out"].append(out.detach().double().cpu())
        got["lse"].append(lse.permute(2, 0, 1).double().cpu())
        got["dq"].append(qm.grad.double().cpu())
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    result = {name: torch.cat(parts)[inverse] for name, parts in got.items()}
    result["dk"], result["dv"] = k_all.grad.double().cpu()[inverse], v_all.grad.double().cpu()[inverse]
    reference = {"out": ref_out.detach(), "lse": ref_lse, "dq": ref_leaves[0].grad, "dk": ref_leaves[1].grad,
                 "dv": ref_leaves[2].grad}
    return result, reference


def _cases(cps):
    cycle = itertools.cycle(itertools.product((True, False), (8, 2, 1)))
    for cp, layout, inner in itertools.product(cps, LAYOUTS, (1, 2)):
        causal, kv_heads = next(cycle)
        yield pytest.param(cp, layout, inner, causal, kv_heads,
                           id=f"P{cp}-{layout}-{'ring' if inner == 1 else 'a2a+p2p'}-"
                              f"{'causal' if causal else 'full'}-hkv{kv_heads}")


@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads", list(_cases((2, 4, 8, 16))))
def test_member_schedules_on_one_cpu_match_fp64_reference(cp, layout, inner, causal, kv_heads):
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        result, reference = run_members(layout, cp, inner, causal, kv_heads, dtype, "cpu", seq_len=6 * cp)
        for name, ref in reference.items():
            err = (result[name] - ref).abs().max().item()
            assert err <= tol, f"{dtype} {name}: max abs error {err:.2e} > {tol}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one ring member per call on one device)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads",
                         [c for cp in (2, 4, 8, 16) for c in itertools.product(
                             [cp], LAYOUTS, (1, 2), (True, False), (8, 2, 1))])
def test_member_schedules_on_cuda_are_as_accurate_as_one_fused_call(dtype, cp, layout, inner, causal, kv_heads):
    seq_len = 2048
    result, reference = run_members(layout, cp, inner, causal, kv_heads, dtype, "cuda", seq_len)
    # One member holding the whole sequence: a single fused kernel call, same heads and dtype.
    fused, fused_ref = run_members("contiguous", 1, 1, causal, kv_heads, dtype, "cuda", seq_len, head_group=inner)
    for name, ref in reference.items():
        err = (result[name] - ref).abs().max().item()
        fused_err = (fused[name] - fused_ref[name]).abs().max().item()
        assert err <= 1.5 * fused_err, f"{name}: {err:.3e} > 1.5 x fused {fused_err:.3e}"
