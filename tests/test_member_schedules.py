"""Each ring member's schedule run on one device, the other members' K/V laid out locally.

This is how a multi-rank schedule is checked on one GPU (NCCL refuses two ranks on one GPU and gloo
cannot send CUDA tensors): member ``m`` of a ring of ``P / inner`` runs its tasks through
``LocalRotation(m, ring)`` over every member's K/V shard; the dK/dV of all members are summed. A flat
ring is ``inner = 1``; ``inner = 2`` is one all-to-all rank of an ``a2a+p2p`` member (its heads: the
first ``h / 2`` query heads and their KV heads, replicated when ``h_kv < 2``).

Compared with an independent fp64 full attention over the same heads: out, lse, dq, dk, dv.
CPU (always): fp64 within 1e-10 and fp32 within 1e-5. Half precision (bf16 on the CPU's fused op,
always; bf16 and fp16 on CUDA, skipped without a GPU): within ``half_precision_tolerance``, which
holds by construction. Each block's out, dq, dk and dv come back from the op rounded to the half
dtype and are summed (in fp32) over the ``B`` blocks that touch a row; rounding errors of ``B``
partials grow like ``sqrt(B)`` (a fused call is ``B = 1``), so the bar for each output is

    1.5 * sqrt(B) * max(error of one fused call over the whole sequence, u * max|reference|)

with ``u`` the unit roundoff of the partials' dtype (2**-8 bf16, 2**-11 fp16; 2**-24 for the
fp32 lse the ops return) and ``B`` counted from the schedule: per query row for out, lse and dq,
per key row (over every member and step) for dk and dv. ``u * max|reference|`` is what rounding
the exact result once costs, so no kernel, fused or not, can be held below it. "At most 1.5x one
fused call", the former bar, cannot hold for dK/dV at P >= 4 (an emulation gave 1.7-3x; see
``test_the_former_bar_fails_for_summed_half_precision_partials``).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from mcp_context.algorithms.executor import RingAttention, RingPlan
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels import get_kernel
from mcp_context.layouts import spans_positions
from mcp_context.masks import CAUSAL, FULL
from mcp_context.schedule import gathered_tasks, layout_schedule
from tests.reference import full_attention, random_qkv

HEADS, HEAD_DIM = 8, 16
LAYOUTS = ("zigzag", "contiguous", "striped")


def _heads(inner: int, kv_heads: int) -> tuple[slice, slice]:
    """Query and KV heads that all-to-all rank 0 of a group of ``inner`` holds (with fewer KV heads than
    ranks each KV head is replicated, so rank 0 holds KV head 0)."""
    return slice(0, HEADS // inner), slice(0, max(1, kv_heads // inner))


def run_members(layout, cp, inner, causal, kv_heads, dtype, device, seq_len, head_group=None, seed=0,
                gathered=False):
    """Every member's out/lse/dq and the summed dK/dV, next to the fp64 reference of the same heads.

    ``head_group``: the all-to-all degree whose rank-0 heads are used (default ``inner``). ``gathered``:
    each member runs its all-gather plan (``schedule.gathered_tasks``: one step against the whole
    sequence's K/V in position order), as all_gather and a2a+all_gather do."""
    q, k, v, dout = random_qkv(seq_len, 1, HEADS, kv_heads, HEAD_DIM, seed=seed)
    q_heads, kv_idx = _heads(head_group or inner, kv_heads)
    q, dout = q[:, :, q_heads], dout[:, :, q_heads]
    k, v = k[:, :, kv_idx], v[:, :, kv_idx]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = full_attention(*ref_leaves, causal, HEAD_DIM ** -0.5)
    ref_out.backward(dout)

    kernel = get_kernel("auto", torch.device(device), dtype, head_dim=HEAD_DIM)
    schedule = layout_schedule(layout, cp, seq_len, CAUSAL if causal else FULL, inner, kernel.capabilities.masks)
    ring = schedule.ring_size
    positions = [spans_positions(spans) for spans in schedule.member_spans]
    order = torch.arange(seq_len) if gathered else torch.cat(positions)  # K/V rows: position or member order
    k_all, v_all = (x[order].to(device, dtype).requires_grad_() for x in (k, v))
    got = {"out": [], "lse": [], "dq": []}
    q_blocks, k_blocks = torch.zeros(seq_len, dtype=torch.long), torch.zeros(seq_len, dtype=torch.long)
    plans = []
    for member in range(ring):
        tasks = gathered_tasks(schedule, member, kernel.capabilities.masks) if gathered else schedule.tasks[member]
        rotation = LocalRotation(0, 1) if gathered else LocalRotation(member, ring)
        plans.append(RingPlan.build(tasks, rotation, kernel, HEAD_DIM ** -0.5, len(positions[member])))
        for step, step_tasks in enumerate(tasks):
            for t in step_tasks:
                q_blocks[positions[member][slice(*t.q)]] += 1
                kv_rows = order if gathered else positions[schedule.kv_source(member, step)]
                k_blocks[kv_rows[slice(*t.kv)]] += 1
    for member in range(ring):
        rows = positions[member]
        qm = q[rows].to(device, dtype).requires_grad_()
        out, lse = RingAttention.apply(qm, k_all, v_all, plans[member])
        out.backward(dout[rows].to(device, dtype))
        got["out"].append(out.detach().double().cpu())
        got["lse"].append(lse.permute(2, 0, 1).double().cpu())
        got["dq"].append(qm.grad.double().cpu())
    def inverse_of(rows):
        inverse = torch.empty_like(rows)
        inverse[rows] = torch.arange(seq_len)
        return inverse

    result = {name: torch.cat(parts)[inverse_of(torch.cat(positions))] for name, parts in got.items()}
    result["dk"], result["dv"] = (x.grad.double().cpu()[inverse_of(order)] for x in (k_all, v_all))
    reference = {"out": ref_out.detach(), "lse": ref_lse, "dq": ref_leaves[0].grad, "dk": ref_leaves[1].grad,
                 "dv": ref_leaves[2].grad}
    result["blocks"] = {name: int((q_blocks if name in ("out", "lse", "dq") else k_blocks).max())
                        for name in reference}
    return result, reference


UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def half_precision_tolerance(name: str, dtype: torch.dtype, blocks: int, fused_err: float,
                             reference: torch.Tensor) -> float:
    """The bar for output ``name`` (see the module docstring): ``1.5 * sqrt(blocks) * max(fused_err,
    u * max|reference|)``; the lse comes back from every op in fp32, the rest in ``dtype``."""
    u = UNIT_ROUNDOFF[torch.float32 if name == "lse" else dtype]
    return 1.5 * blocks ** 0.5 * max(fused_err, u * reference.abs().max().item())


def half_precision_errors(layout, cp, inner, causal, kv_heads, dtype, device, seq_len, gathered=False):
    """``{name: (error, tolerance, error of one fused call, blocks)}`` for every member's schedule in
    ``dtype`` against the fp64 reference; the fused call holds the whole sequence (one member)."""
    result, reference = run_members(layout, cp, inner, causal, kv_heads, dtype, device, seq_len, gathered=gathered)
    fused, fused_ref = run_members("contiguous", 1, 1, causal, kv_heads, dtype, device, seq_len, head_group=inner)
    errors = {}
    for name, ref in reference.items():
        err = (result[name] - ref).abs().max().item()
        fused_err = (fused[name] - fused_ref[name]).abs().max().item()
        blocks = result["blocks"][name]
        errors[name] = (err, half_precision_tolerance(name, dtype, blocks, fused_err, ref), fused_err, blocks)
    return errors


def _assert_within_half_precision_tolerance(errors: dict) -> None:
    for name, (err, tol, fused_err, blocks) in errors.items():
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e} (fused call {fused_err:.3e}, {blocks} blocks summed)"


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


GATHERED = [pytest.param(cp, layout, inner, causal, kv_heads, id=f"P{cp}-{layout}-"
                         f"{'all_gather' if inner == 1 else 'a2a+all_gather'}-{'causal' if causal else 'full'}-hkv{kv_heads}")
            for cp, layout, inner, causal, kv_heads in ((2, "zigzag", 1, True, 2), (4, "zigzag", 1, True, 8),
                                                        (8, "zigzag", 1, True, 1), (8, "zigzag", 2, True, 8),
                                                        (4, "contiguous", 1, True, 2), (4, "contiguous", 2, False, 8),
                                                        (16, "zigzag", 1, False, 2), (16, "zigzag", 2, True, 2))]


@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads", GATHERED)
def test_gathered_member_plans_on_one_cpu_match_fp64_reference(cp, layout, inner, causal, kv_heads):
    """The all-gather plans (each query run against its visible keys in position order, in a few calls)."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        result, reference = run_members(layout, cp, inner, causal, kv_heads, dtype, "cpu", seq_len=6 * cp,
                                        gathered=True)
        for name, ref in reference.items():
            err = (result[name] - ref).abs().max().item()
            assert err <= tol, f"{dtype} {name}: max abs error {err:.2e} > {tol}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one ring member per call on one device)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads", GATHERED)
def test_gathered_member_plans_on_cuda_meet_the_half_precision_tolerance(dtype, cp, layout, inner, causal, kv_heads):
    _assert_within_half_precision_tolerance(
        half_precision_errors(layout, cp, inner, causal, kv_heads, dtype, "cuda", seq_len=2048, gathered=True))


@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads", [(4, "zigzag", 1, True, 2), (8, "zigzag", 1, True, 8)],
                         ids=["P4-zigzag-ring-causal-hkv2", "P8-zigzag-ring-causal-hkv8"])
def test_member_schedules_in_bf16_on_cpu_meet_the_stated_tolerance(cp, layout, inner, causal, kv_heads):
    """The half-precision bar of the CUDA test, checked with the CPU's fused op in bf16 (same rounding
    of every block's partials to bf16, summed in fp32)."""
    _assert_within_half_precision_tolerance(
        half_precision_errors(layout, cp, inner, causal, kv_heads, torch.bfloat16, "cpu", seq_len=512))


def test_the_former_bar_fails_for_summed_half_precision_partials():
    """Why the bar scales with sqrt(blocks): at P = 8 (a2a+p2p [2, 4], striped, full) the gradients summed
    from bf16 partials of the CPU fused op exceed "1.5x one fused call" (the former premise: dq 2.2x
    here), while meeting the stated tolerance."""
    errors = half_precision_errors("striped", 8, 2, False, 8, torch.bfloat16, "cpu", seq_len=512)
    assert max(errors[name][0] / errors[name][2] for name in ("dq", "dk", "dv")) > 1.5, errors
    _assert_within_half_precision_tolerance(errors)


def _cuda_cases():
    for cp, layout, inner, causal, kv_heads in itertools.product((2, 4, 8, 16), LAYOUTS, (1, 2), (True, False),
                                                                (8, 2, 1)):
        yield pytest.param(cp, layout, inner, causal, kv_heads,
                           id=f"P{cp}-{layout}-{'ring' if inner == 1 else 'a2a+p2p'}-"
                              f"{'causal' if causal else 'full'}-hkv{kv_heads}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one ring member per call on one device)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cp,layout,inner,causal,kv_heads", list(_cuda_cases()))
def test_member_schedules_on_cuda_meet_the_half_precision_tolerance(dtype, cp, layout, inner, causal, kv_heads):
    _assert_within_half_precision_tolerance(
        half_precision_errors(layout, cp, inner, causal, kv_heads, dtype, "cuda", seq_len=2048))


@pytest.mark.parametrize("cp,layout,mask", [(8, "zigzag", "causal"), (4, "contiguous", "causal"), (4, "zigzag", "full")])
def test_gathered_plans_sum_dkv_in_bf16_bit_for_bit_as_fp32_then_one_cast(cp, layout, mask):
    """An all-gather plan adds at most two blocks into any key row, so its dK/dV buffer can be bf16: the
    result is bit-for-bit what summing in fp32 and casting once gives (the fp32 buffer it replaced), and the
    buffer is half the size."""
    import dataclasses

    from mcp_context.algorithms.executor import most_blocks_per_key, ring_backward, ring_forward

    seq = 32 * cp
    kernel = get_kernel("torch:cpu_flash", torch.device("cpu"), torch.bfloat16, head_dim=HEAD_DIM)
    schedule = layout_schedule(layout, cp, seq, CAUSAL if mask == "causal" else FULL, 1, kernel.capabilities.masks)
    q, k, v, dout = (x.to(torch.bfloat16) for x in random_qkv(seq, 1, HEADS, 2, HEAD_DIM, seed=3))
    positions = [spans_positions(spans) for spans in schedule.member_spans]
    for member in range(cp):
        tasks = gathered_tasks(schedule, member, kernel.capabilities.masks)
        assert most_blocks_per_key(tasks) <= 2
        plan = RingPlan.build(tasks, LocalRotation(0, 1), kernel, HEAD_DIM ** -0.5, len(positions[member]))
        assert plan.kv_sums_exact and plan.kv_dtype(torch.bfloat16) == torch.bfloat16
        qm, dm = q[positions[member]], dout[positions[member]]
        out, lse = ring_forward(qm, k, v, plan)
        got = ring_backward(dm, qm, k, v, out, lse, plan)
        want = ring_backward(dm, qm, k, v, out, lse, dataclasses.replace(plan, kv_sums_exact=False))
        for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
            assert torch.equal(a, b), (member, name)
    ring = RingPlan.build(schedule.tasks[0], LocalRotation(0, cp), kernel, HEAD_DIM ** -0.5, len(positions[0]))
    assert not ring.kv_sums_exact  # one member of a ring: the other members add to its sums
