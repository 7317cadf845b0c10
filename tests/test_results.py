"""How a member holds its results (``algorithms/results.py``): the roles each call plays on its query rows,
and the executor's results through every role against an fp64 reference, forward and gradients.
"""
from __future__ import annotations

import pytest
import torch

from mcp_context.algorithms.executor import RingAttention, RingPlan
import dataclasses

from mcp_context.algorithms.results import FIRST, FOLD, FOLD_LAST, HOLD, OWN, Piece, ResultPlan, folds
from mcp_context.algorithms.rotation import LocalRotation
from mcp_context.kernels.torch_sdpa import cpu_flash_kernel
from mcp_context.masks import CAUSAL
from mcp_context.schedule import BlockTask
from tests.reference import relative_error
from tools.rank_step import rank_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _roles(plan: ResultPlan) -> list[list[list[tuple]]]:
    return [[[(p.rows, p.role) for p in task] for task in step] for step in plan.pieces]


def _steps(plan: ResultPlan) -> list[list[list[tuple]]]:
    """Each piece as ``(rows, role, held steps, summed)`` (every task here is its step's only one: task 0)."""
    return [[[(p.rows, p.role, tuple(s for s, _ in p.held), p.summed) for p in task] for task in step]
            for step in plan.pieces]


def test_a_zigzag_member_keeps_its_step_0_output_and_merges_its_ring_blocks_a_few_at_a_time():
    """P = 8, 32K, rank 0: the step-0 call covers both chunks, its first chunk is no other block's (OWN, so
    its output is the result), the second chunk meets all 8 blocks: out merges them in 2 kernels (``OUT_ARITY``
    5: the first five into an fp32 sum at step 4, the sum and the last three into the result at step 7), dQ in 4
    (``DQ_ARITY`` 3). Rank 3: the first chunk meets 4 blocks, merged at step 3 into the result; the call that
    merges them merges the second chunk's first 4 blocks too (into the fp32 sum), so the whole blocks of steps
    0-2 are released there rather than held on; no row is the step-0 call's alone, so it is not kept as the
    result."""
    kernel = cpu_flash_kernel()
    zero = rank_step("p2p", 8, 32768, CAUSAL, kernel, 32, 8, 128, rank=0).plan
    half, full, early = (2048, 4096), (0, 4096), (0, 2048)
    hold = [[(half, HOLD, (), False)]]
    assert _steps(zero.results) == [[[(early, OWN, (), False), (half, HOLD, (), False)]]] + [hold] * 3 + [
        [[(half, FOLD, (0, 1, 2, 3), False)]], hold, hold, [[(half, FOLD_LAST, (5, 6), True)]]]
    assert zero.results.adopted == (0, 0) and zero.results.accumulator == half and zero.results.covered
    assert zero.results.releases[4][0] == tuple((s, 0) for s in range(4)) and not zero.results.releases[3][0]
    assert _steps(zero.dq_results) == [[[(early, OWN, (), False), (half, HOLD, (), False)]], hold,
                                       [[(half, FOLD, (0, 1), False)]], hold, [[(half, FOLD, (3,), True)]], hold,
                                       [[(half, FOLD, (5,), True)]], [[(half, FOLD_LAST, (), True)]]]
    three = rank_step("p2p", 8, 32768, CAUSAL, kernel, 32, 8, 128, rank=3).plan.results
    assert _steps(three) == [[[(full, HOLD, (), False)]]] * 3 + [
        [[(early, FOLD_LAST, (0, 1, 2), False), (half, FOLD, (0, 1, 2), False)]]] + [hold] * 3 + [
        [[(half, FOLD_LAST, (4, 5, 6), True)]]]
    assert three.adopted is None and three.accumulator == half and three.releases[3][0] == ((0, 0), (1, 0), (2, 0))


def test_a_fold_reads_at_most_arity_blocks_and_goes_through_fp32_past_that():
    """The roles of a row's ``n`` blocks (``folds``): up to ``arity`` blocks, every block held and the last
    merging them all into the result; past it, a merge into the fp32 sum every ``arity`` partial results (the
    sum counting as one), the last into the result. Arity 2 is one block at a time (a pair, then every block
    into the sum). The zigzag rank 0 at arity 3: its 8 blocks in 4 merges, an fp32 accumulator over the half
    they meet."""
    assert folds(1) == [(OWN, 0, False)] and folds(3, through=True) == [(FIRST, 0, False), (FOLD, 0, True),
                                                                        (FOLD, 0, True)]
    assert folds(4, arity=8) == [(HOLD, 0, False)] * 3 + [(FOLD_LAST, 3, False)]
    assert folds(5, arity=2) == [(HOLD, 0, False), (FOLD, 1, False), (FOLD, 0, True), (FOLD, 0, True),
                                 (FOLD_LAST, 0, True)]
    assert folds(8, arity=3) == [(HOLD, 0, False), (HOLD, 0, False), (FOLD, 2, False), (HOLD, 0, False),
                                 (FOLD, 1, True), (HOLD, 0, False), (FOLD, 1, True), (FOLD_LAST, 0, True)]
    tasks = rank_step("p2p", 8, 32768, CAUSAL, cpu_flash_kernel(), 32, 8, 128, rank=0).plan.tasks
    plan = ResultPlan.build(tasks, 4096, arity=3)
    assert [p.role for step in plan.pieces for task in step for p in task if p.rows == (2048, 4096)] == [
        role for role, _, _ in folds(8, arity=3)]
    assert plan.accumulator == (2048, 4096) and plan.pieces[4][0][0].held == ((3, 0),)


def test_an_all_gathers_calls_merge_once_into_the_result_with_no_fp32_buffer():
    """all_gather, rank 0: the first chunk's causal call is its rows' only block; the second chunk meets two
    calls (its prefix and its diagonal), so the second merges straight into the result and no row needs an
    fp32 accumulator."""
    plan = rank_step("all_gather", 8, 32768, CAUSAL, cpu_flash_kernel(), 32, 8, 128).plan.results
    assert _roles(plan) == [[[((0, 2048), OWN)], [((2048, 4096), HOLD)], [((2048, 4096), FOLD_LAST)]]]
    assert plan.pieces[0][2][0].held == ((0, 1),) and plan.accumulator is None and plan.adopted is None


def test_through_sends_every_row_through_one_fp32_accumulator():
    tasks = [[BlockTask((0, 8), (0, 8)), BlockTask((4, 12), (8, 16))]]
    plan = ResultPlan.build(tasks, 16, through=True)
    assert _roles(plan) == [[[((0, 8), FIRST)], [((4, 8), FOLD), ((8, 12), FIRST)]]]
    assert plan.pieces[0][1][0].summed and plan.accumulator == (0, 16) and not plan.covered and plan.through


# Two steps of a ring of two on one device (member 0: keys 0-31 at step 0, 32-63 at step 1), calls whose query
# runs overlap every way: rows met by 2, 3 and 4 blocks, rows one call writes, rows nobody writes (60-63), a
# first call that is not over every row, and holders read across steps.
ROWS = 64
TASKS = [
    [BlockTask((0, 40), (0, 16)), BlockTask((16, 60), (16, 32))],
    [BlockTask((8, 24), (0, 16)), BlockTask((0, 56), (16, 32))],
]


def test_mixed_overlaps_get_every_role_and_each_holder_is_released_at_its_last_reader():
    # rows 0-7: 2 blocks; 8-15: 3; 16-23: 4; 24-39: 3; 40-55: 2 (the first held by the second call); 56-59: 1
    pair = ResultPlan.build(TASKS, ROWS, arity=2)  # one block at a time
    assert _roles(pair) == [
        [[((0, 40), HOLD)], [((16, 40), FOLD), ((40, 56), HOLD), ((56, 60), OWN)]],
        [[((8, 16), FOLD), ((16, 24), FOLD)], [((0, 8), FOLD_LAST), ((8, 40), FOLD_LAST), ((40, 56), FOLD_LAST)]],
    ]
    assert pair.pieces[0][1][0] == Piece((16, 40), FOLD, ((0, 0),)) and pair.pieces[1][1][2].held == ((0, 1),)
    assert pair.pieces[1][0][1] == Piece((16, 24), FOLD, (), True) and pair.pieces[1][1][1].summed
    assert pair.releases == (((), ()), ((), ((0, 0), (0, 1))))
    assert pair.accumulator == (8, 40) and not pair.covered and pair.adopted is None
    once = ResultPlan.build(TASKS, ROWS)  # every row's blocks merged once, by its last block's call
    assert _roles(once) == [
        [[((0, 40), HOLD)], [((16, 56), HOLD), ((56, 60), OWN)]],
        [[((8, 24), HOLD)], [((0, 8), FOLD_LAST), ((8, 16), FOLD_LAST), ((16, 24), FOLD_LAST), ((24, 40), FOLD_LAST),
                             ((40, 56), FOLD_LAST)]],
    ]
    assert [p.held for p in once.pieces[1][1]] == [((0, 0),), ((0, 0), (1, 0)), ((0, 0), (0, 1), (1, 0)),
                                                   ((0, 0), (0, 1)), ((0, 1),)]
    assert once.releases == (((), ()), ((), ((0, 0), (0, 1), (1, 0)))) and once.accumulator is None


def _reference(q, k, v, dout):
    """Attention over the pairs ``TASKS`` make visible, in fp64 (rows that see nothing: 0), and its gradients."""
    visible = torch.zeros(ROWS, ROWS, dtype=torch.bool)
    for step, tasks in enumerate(TASKS):
        for t in tasks:
            visible[t.q[0]:t.q[1], 32 * step + t.kv[0]:32 * step + t.kv[1]] = True
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("sbhd,tbhd->bhst", qd, kd.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    out = torch.einsum("bhst,tbhd->sbhd", p, vd.repeat_interleave(group, 2))
    out.backward(dout.double())
    return out.detach(), lse, qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize("arity", [2, 3, 8])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_every_role_gives_exact_attention_forward_and_gradients(dtype, tol, arity):
    """The executor through all of the roles above equals masked attention in fp64: out, lse, dq, dk, dv,
    within ``tol`` x max(1, |ref|) (bf16: the inputs' rounding; results rounded once), merging one block at a
    time (arity 2), through an fp32 sum with held blocks beside it (3: rows 16-23 meet 4 blocks) and once."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, 1, 4, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(ROWS, 1, 2, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(ROWS, 1, 4, 16, generator=g).to(dtype)
    plan = RingPlan.build(TASKS, LocalRotation(0, 2), cpu_flash_kernel(), 16 ** -0.5, ROWS)
    plan = dataclasses.replace(plan, results=ResultPlan.build(TASKS, ROWS, arity=arity),
                               dq_results=ResultPlan.build(TASKS, ROWS, arity=arity))
    out, lse = RingAttention.apply(q, k, v, plan)
    out.backward(dout)
    ref = _reference(q, k, v, dout)
    assert out.dtype == q.grad.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else
                                                                torch.float32)
    assert (out[60:] == 0).all() and (lse[..., 60:] == float("-inf")).all() and (q.grad[60:] == 0).all()
    finite = ref[1].isfinite()
    assert torch.equal(lse.isfinite(), finite)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), ref):
        if name == "lse":
            got, want = got[finite], want[finite]
        err = relative_error(got, want)
        assert err <= tol, (name, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's fused op, compiled merges)")
def test_on_cuda_every_role_gives_exact_attention_with_cudnn_and_compiled_merges():
    """The same plan on an NVIDIA GPU: ``torch:cudnn`` in bf16, the merges and dQ sums compiled (their
    in-place and held-row forms: the compiled regions read rows they overwrite), at arities 2, 3 and 8, against
    fp64 attention within 2e-2 x max(1, |ref|). Passed on an H200 (2026-11-27, main dd6c460)."""
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel

    kernel = TorchKernel(FUSED_OPS["cudnn"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, 1, 4, 128, generator=g).bfloat16().cuda().requires_grad_()
    k, v = (torch.randn(ROWS, 1, 2, 128, generator=g).bfloat16().cuda().requires_grad_() for _ in range(2))
    dout = torch.randn(ROWS, 1, 4, 128, generator=g).bfloat16().cuda()
    ref = _reference(*(x.cpu() for x in (q, k, v, dout)))
    finite = ref[1].isfinite()
    for arity in (2, 3, 8):
        plan = RingPlan.build(TASKS, LocalRotation(0, 2), kernel, 128 ** -0.5, ROWS)
        plan = dataclasses.replace(plan, results=ResultPlan.build(TASKS, ROWS, arity=arity),
                                   dq_results=ResultPlan.build(TASKS, ROWS, arity=arity))
        q.grad = k.grad = v.grad = None
        out, lse = RingAttention.apply(q, k, v, plan)
        out.backward(dout)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), ref):
            got = got.detach().cpu()
            if name == "lse":
                got, want = got[finite], want[finite]
            err = relative_error(got, want)
            assert err <= 2e-2, (arity, name, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's fused op, compiled merges)")
@pytest.mark.parametrize("sized", ["0", "1"], ids=["one-call-per-task", "sized-calls"])
def test_on_cuda_a_zigzag_member_gives_what_it_gives_in_fp64(monkeypatch, sized):
    """A P = 8 zigzag member at 8K (rank 3: its first chunk's blocks merge at step 3, the second's at step 7;
    8 query heads, 2 K/V heads, bf16, cuDNN) against the same member in fp64 through the math kernel, within
    2e-2 x max(1, |ref|): one call per task (the default), and with the calls sized to the GPU
    (``MCP_CONTEXT_SIZED_CALLS=1``: its blocks' keys split in 2 and 4 parts on an H200). On an H200
    (2026-11-27, main dd6c460) the sized calls gave out 5-8 % off and lse 10 % off, in every merge arity, eager
    and in order too, where the same plan with the same calls was exact on a CPU: the split calls handed cuDNN
    a head-major query stack beside token-major keys (since laid out alike: ``algorithms/calls.stacked``); not
    yet rerun on a GPU."""
    from mcp_context.algorithms.executor import ring_backward, ring_forward
    from mcp_context.kernels.math import MathKernel
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel

    monkeypatch.setenv("MCP_CONTEXT_SIZED_CALLS", sized)
    kernel = TorchKernel(FUSED_OPS["cudnn"])
    step = rank_step("p2p", 8, 8192, CAUSAL, kernel, 8, 2, 128, rank=3)
    exact = dataclasses.replace(step.plan, kernel=MathKernel())  # the same member in fp64, the math kernel
    q, dout = (torch.randn(step.q_rows, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(step.kv_rows, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got, want = [], []
    for p, inputs, into in ((step.plan, (q, k, v, dout), got), (exact, [x.double() for x in (q, k, v, dout)], want)):
        o, l = ring_forward(*inputs[:3], p)
        into += [o, l, *ring_backward(inputs[3], *inputs[:3], o, l, p)[:3]]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        err = relative_error(a, b)
        assert err <= 2e-2, (name, err)
