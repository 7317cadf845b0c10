"""What packed documents move: a packing whose documents stay on their rank posts no transfer, and a
ring whose reads end early stops after the last step any member reads. Results stay exact against
the fp64 reference with a document mask (``tests.reference``)."""
from __future__ import annotations

import torch

from mcp_context.layouts import shard_sequence
from tests._dist import run_distributed
from tests.reference import document_ids, full_attention, random_qkv


def _p2p_packed_case(rank, world, layout, n, cu_list, heads, kv_heads, head_dim, seed):
    """p2p over ``world`` ranks of ``n`` rows, documents ``cu_list``: per op, (bytes, transfers) this rank
    sent, and the max error of out, dq, dk, dv."""
    from mcp_context import build_hcp_groups, context_parallel_attention
    from mcp_context.trace import comm_stats

    cu = torch.tensor(cu_list, dtype=torch.int32)
    q, k, v, dout = random_qkv(world * n, 1, heads, kv_heads, head_dim, seed=seed)
    leaves = [shard_sequence(x, world, rank, layout, 0, cu).requires_grad_() for x in (q, k, v)]
    before, _, before_calls = comm_stats.snapshot()
    out = context_parallel_attention(*leaves, build_hcp_groups([world]), layout=layout, comm="p2p", cu_seqlens=cu,
                                     check_ranks=False)
    out.backward(shard_sequence(dout, world, rank, layout, 0, cu))
    after, _, after_calls = comm_stats.snapshot()
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, _ = full_attention(*ref, True, head_dim ** -0.5, documents=document_ids(world * n, cu_list))
    ref_out.backward(dout)
    err = max((a - shard_sequence(b, world, rank, layout, 0, cu)).abs().max().item()
              for a, b in zip([out] + [x.grad for x in leaves], [ref_out] + [x.grad for x in ref]))
    moved = {op: (after.get(op, 0) - before.get(op, 0), after_calls.get(op, 0) - before_calls.get(op, 0))
             for op in ("ring_kv", "ring_dkv")}
    return moved, err


def test_documents_that_stay_on_their_rank_post_no_transfer():
    """p2p, 4 ranks, documents of half a shard placed whole: every step but the own one is empty, so the
    halo rotation posts no K/V or dK/dV transfer at all, and the result is exact."""
    n = 16
    for moved, err in run_distributed(4, _p2p_packed_case, "balanced", n, list(range(0, 4 * n + 1, n // 2)), 4, 2, 8,
                                      7):
        assert moved == {"ring_kv": (0, 0), "ring_dkv": (0, 0)} and err <= 1e-10, (moved, err)


def test_the_ring_stops_after_the_last_step_any_member_reads():
    """P = 8, contiguous, documents of 3.5 shards: a member reads at most 3 shards back (more than the halo's
    two, so the ring runs), so the ring walks 4 steps, not 8: 3 K/V transfers per walk (forward and
    backward) and 4 dK/dV sends (3 hops, then straight home) instead of 7, 7 and 8; results exact."""
    n = 8
    for moved, err in run_distributed(8, _p2p_packed_case, "contiguous", n, [0, 7 * n // 2, 7 * n, 8 * n], 2, 2, 4,
                                      11):
        assert {op: calls for op, (_, calls) in moved.items()} == {"ring_kv": 6, "ring_dkv": 4} and err <= 1e-10, \
            (moved, err)
