"""The work outside the attention calls of one rank's step, pinned per scheme (``tools/step_ops.py``).

Counted on fake CUDA bf16 tensors with the cuDNN op, Llama-3-8B heads (32 query / 8 KV, d = 128), S = 32K
over P = 8, causal zigzag, rank 0 (a compiled merge counts as the two kernels it launches on a GPU, the
compiled dK/dV add as one).
A change that adds a kernel to the hot path fails here; one that removes work updates the pins.
The H200 profile of the same steps (docs/performance.md) shows the kernels the count cannot see (inside
the cuDNN calls, the autograd engine's gradient accumulation in the benchmark).
"""
from __future__ import annotations

import pytest

from mcp_context.algorithms.results import DQ_ARITY, HOLD, OUT_ARITY, folds
from mcp_context.masks import SlidingWindow
from tools.step_ops import count_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # FakeTensorMode's "CUDA not available" notes

# scheme: (attention calls per pass, ops forward, ops backward, most bytes moved / the rank's outputs)
PINNED = {
    "p2p": (8, 5, 16, 16.0),  # the ring as the member walks it: its K/V packed into one message each way
    "all_gather": (3, 4, 8, 9.0),  # dK/dV handed on as strided views: the gather's reorder copies them anyway
    "a2a": (1, 0, 1, 0.05),  # one call over every row: its out, dq, dk, dv are the results (lse made finite: 1)
    "a2a+p2p": (4, 2, 9, 7.0),  # K/V arrive packed (they crossed the all-to-all so): no packing here
    "a2a+all_gather": (3, 4, 8, 6.0),
}


@pytest.mark.parametrize("comm", list(PINNED))
def test_the_ops_outside_attention_are_pinned_per_scheme(comm):
    count = count_step(comm, 32768, 8)
    calls, fwd, bwd, moved = PINNED[comm]
    assert (count.calls, count.forward.ops, count.backward.ops) == (calls, fwd, bwd), (
        count.forward.by_op, count.backward.by_op)
    assert count.bytes <= moved * count.output_bytes, count.bytes / count.output_bytes
    assert count.forward.attention_calls == calls  # one cuDNN call per task forward
    assert count.ops <= 40  # the bound at P = 8 (the H200 profile of the old step: ~100 kernels)


# scheme: every op the host dispatches in one rank's fwd+bwd (views, allocations and calls included; a fused
# region's call counts one), 2026-11-27: p2p 250 -> 167 (messages viewed with as_strided, K/V straight from them,
# the query rows a pass reads viewed once a span)
HOST_OPS = {"p2p": 167, "all_gather": 85, "a2a": 22, "a2a+p2p": 105, "a2a+all_gather": 85}


@pytest.mark.parametrize("comm", list(HOST_OPS))
def test_the_ops_the_host_dispatches_are_pinned_per_scheme(comm):
    """A short step is the host's (the 32K/P8 ring took the H200's host 7.7 ms to issue beside 7.7 ms of GPU
    work), and every view, allocation and call costs the host a few µs whatever its size: a change that adds
    one to the hot path fails here; one that removes some updates the pin."""
    count = count_step(comm, 32768, 8)
    assert count.host_ops == HOST_OPS[comm], (count.forward.host_ops, count.backward.host_ops)


def test_a_single_call_plan_adds_no_byte_around_the_fused_op():
    """a2a (a ring of one, one causal call): the fused op's out, dq, dk and dv are the results as they are
    (no fp32 round trip, no fill, no copy), bit for bit what the accumulators gave (tests/test_merge.py,
    tests/test_cuda_rehearsal.py); what is left is the backward's finite lse (read and written in fp32: 1/80 of the outputs' bytes at d = 128)."""
    count = count_step("a2a", 32768, 8)
    assert dict(count.forward.by_op) == {} and dict(count.backward.by_op) == {"nan_to_num": 1}
    assert count.bytes <= count.output_bytes / 64


def test_the_ring_step_merges_its_blocks_a_few_at_a_time():
    """p2p: the step-0 call covers every row, so its out and dQ are the results, and the later blocks meet
    the half of the rows the zigzag's second chunk holds: forward their outputs are held and merged up to
    ``OUT_ARITY`` at a time (two kernels a merge), the first reading the held step-0 rows, the last writing the
    result (no copy into or out of fp32): 2 merges at P = 8, 4 at 16; backward the same for dQ up to
    ``DQ_ARITY`` at a time (4 sums at P = 8, 8 at 16), and one fused dK/dV add per block; two kernels for the two
    distinct query spans' lse; one copy for dK and dV together (summed in fp32 around the ring in one packed
    buffer, cast to the inputs' dtype at once); the own K/V packed into a message once each way; the dK/dV sum
    this member starts is its first block's (written, not filled and added)."""
    for cp, merges, sums in ((8, 2, 4), (16, 4, 8)):
        assert sum(role != HOLD for role, _, _ in folds(cp, arity=OUT_ARITY)) == merges
        assert sum(role != HOLD for role, _, _ in folds(cp, arity=DQ_ARITY)) == sums
        count = count_step("p2p", 2048 * cp, cp)
        fwd, bwd = count.forward.by_op, count.backward.by_op
        assert fwd == {"merge_blocks_": 2 * merges, "cat": 1}, fwd
        assert bwd["add_kv_"] + bwd["copy_kv_"] == cp and bwd["copy_kv_"] == 1, bwd
        assert bwd["add_blocks_"] == sums and bwd["copy_"] == 1 and "add_" not in bwd, bwd  # dq; the dk/dv cast
        assert bwd["nan_to_num"] == 2 and "fill_" not in bwd and bwd["cat"] == 1, bwd
        assert count.ops == 2 * merges + sums + cp + 5, count.ops


@pytest.mark.parametrize("comm", ["p2p", "a2a+p2p"])
def test_every_rank_of_a_ring_stays_within_the_bound(comm):
    """Ranks move in lockstep, so the busiest one sets the pace: each of the 8 stays at or below 40 ops (seen:
    p2p 21 at rank 0, 24-26 at ranks 1-6, whose first chunk's blocks are merged mid-walk (and the second's with
    them), and 20 at rank 7; a2a+p2p 10-16)."""
    counts = {rank: count_step(comm, 32768, 8, rank=rank).ops for rank in range(8)}
    assert max(counts.values()) <= 40, counts


@pytest.mark.parametrize("rank", [0, 7])
def test_the_cost_model_prices_the_bytes_the_executor_moves(rank):
    """The planner's bytes around the calls (``plan.cost.task_bytes`` over the plan's tasks, plus
    ``layer_bytes``, which holds a flat ring's packing of its own K/V into a message once a pass) are the bytes
    counted here, scheme by scheme, forward and backward together, for the rank that starts the ring and the
    one that ends it, but for the backward's finite lse (``nan_to_num``, 1/80 of dQ), which the model
    leaves out."""
    import torch

    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from mcp_context.masks import CAUSAL
    from mcp_context.plan.cost import Accumulation, layer_bytes, task_bytes
    from mcp_context.plan.dryrun import RankShape
    from tools.rank_step import SCHEMES, rank_step

    for comm in SCHEMES:
        step = rank_step(comm, 8, 32768, CAUSAL, TorchKernel(FUSED_OPS["cudnn"]), 32, 8, 128, rank=rank)
        shape = RankShape(32768, 1, step.heads, step.kv_heads, 128, torch.bfloat16)
        tasks, kv_rows = step.plan.tasks, step.walked()[1]
        held = Accumulation.of(tasks, kv_rows)
        (out, dq), first_keys = held.results(tasks, step.q_rows), held.key_rows(tasks, kv_rows)[0]
        forward = backward = 0
        for t, calls in enumerate(tasks):
            for i, task in enumerate(calls):
                f, b = task_bytes(task, (out.pieces[t][i], dq.pieces[t][i]), (t, i) == out.adopted,
                                  first_keys[t][i], shape, step.heads, step.kv_heads, held)
                forward, backward = forward + f, backward + b
        layer = layer_bytes(shape, step.heads, step.kv_heads, tasks, step.q_rows, kv_rows, held,
                            step.ring and not step.packed_kv)
        count = count_step(comm, 32768, 8, rank=rank)
        fwd, bwd = count.forward, count.backward
        assert forward == fwd.bytes - fwd.bytes_by_op["cat"], (comm, forward, fwd.bytes_by_op)
        assert forward + backward + layer == count.bytes - bwd.bytes_by_op["nan_to_num"], (
            comm, forward + backward + layer, fwd.bytes_by_op, bwd.bytes_by_op)


# scheme: (attention calls per pass, host ops) of rank 0's fwd+bwd over a packed sequence of 20 documents at
# S = 8K, P = 8 (balanced layout), 2026-11-27: one call per document piece a step, and per call its copies, lse
# and dK/dV writes; an unpacked step at this S/P makes 8 calls and 167 host ops (p2p), 1 and 22 (a2a)
PACKED = {"p2p": (101, 1491), "a2a": (20, 466)}


@pytest.mark.parametrize("comm", list(PACKED))
def test_a_packed_steps_calls_and_host_ops_are_pinned(comm):
    """A packed batch's step makes one attention call per document piece it meets a step (``schedule``: a
    task per document's rectangle), each with the host ops around it: the ring's 101 calls a pass here against
    8 unpacked. Pinned so that a change that adds to them fails, and one that collapses them (a step's pieces
    in one variable-length call) updates the pin."""
    from tools.step_ops import random_documents

    count = count_step(comm, 8192, 8, mask=random_documents(8192, 20), layout="balanced")
    assert (count.calls, count.host_ops) == PACKED[comm], (count.calls, count.host_ops)


# scheme: (attention calls per pass, ops outside attention, of them flips, host ops) of rank 1's fwd+bwd with a
# sliding window of 4095 at S = 32K, P = 8, contiguous (the layout the planner picks for a window), 2026-11-28.
# The window's lower edge runs on its rows reversed: 14 flips an anticausal run (forward q, K, V in and out, lse
# back; backward dout, q, K, V, out, lse in and dq, dK, dV back): one run for the ring's member, eight for a2a,
# whose whole sequence is cut in runs of schedule.RUN_ROWS rows.
WINDOWED = {"p2p": (2, 24, 14, 147), "a2a": (18, 174, 112, 454)}


@pytest.mark.parametrize("comm", list(WINDOWED))
def test_a_windowed_steps_flips_are_pinned(comm):
    """A windowed step's work outside attention is mostly the flips of its anticausal runs (``torch_sdpa``: the
    fused ops take no lower edge): pinned, so that a change that adds to them fails and one that removes them
    (a kernel that takes the window natively) updates the pin."""
    count = count_step(comm, 32768, 8, mask=SlidingWindow(4095, 0), layout="contiguous", rank=1)
    flips = count.forward.by_op["flip"] + count.backward.by_op["flip"]
    assert (count.calls, count.ops, flips, count.host_ops) == WINDOWED[comm], (
        count.calls, count.ops, flips, count.host_ops)


def test_the_tool_takes_a_window_and_refuses_a_malformed_one(capsys):
    from tools.step_ops import main

    with pytest.raises(SystemExit):
        main(["--window", "4095"])
    assert "argument --window: '4095' is not LEFT,RIGHT (two integers, -1 for unbounded), e.g. 4095,0" in (
        capsys.readouterr().err)
