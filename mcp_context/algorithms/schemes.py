"""The communication schemes, all as one composition: Ulysses all-to-all, then a ring.

=============  ======================  =====================================================
``comm``       all-to-all over          ring over
=============  ======================  =====================================================
p2p            (none)                  all CP ranks, KV passed point-to-point
all_gather     (none)                  all CP ranks, KV all-gathered once (local rotation)
a2a            all CP ranks             a ring of one (local attention over the full sequence)
a2a+p2p        level 0 (adjacent)       the product of the outer levels, point-to-point
=============  ======================  =====================================================

After the level-0 all-to-all a rank holds its group's tokens for ``h / P0`` heads; putting them in
position order makes the group one member of a ring over ``P / P0`` members whose shards follow the
same layout (a zigzag group is a zigzag shard of the outer ring), so the outer ring runs the same
schedule code. The ring spans all outer levels flattened (member ``m`` = groups in CP-rank order);
it is driven with point-to-point sends to global ranks inside the CP group, so no extra process
group is needed for any depth. Autograd: the all-to-alls and the all-gather are autograd-aware
primitives and the ring is one ``autograd.Function``, so their composition is differentiable.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..comm import HCPGroups, RingExchange, gather_seq, heads_to_seq, seq_to_heads
from ..kernels import Kernel
from ..layouts import canonical_member_spans, layout_spans
from ..schedule import Schedule, layout_schedule
from .executor import RingAttention, RingPlan
from .rotation import LocalRotation, RingRotation

COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")
COMM_ALIASES = {"allgather": "all_gather"}


def a2a_degree(comm: str, groups: HCPGroups) -> int:
    """How many adjacent CP ranks share their tokens by all-to-all before the ring (1: none)."""
    return {"p2p": 1, "all_gather": 1, "a2a": groups.cp_size, "a2a+p2p": groups.sizes[0]}[comm]


@lru_cache(maxsize=256)
def _schedule(layout: str, cp_size: int, seq_len: int, causal: bool, inner: int) -> Schedule:
    return layout_schedule(layout, cp_size, seq_len, causal, inner)


@lru_cache(maxsize=256)
def _member_pieces(layout: str, cp_size: int, seq_len: int, inner: int, member: int) -> tuple:
    """``(start, count)`` row pieces of the all-to-all output, in the order that sorts them by
    position, and the inverse order; ``None`` when the output is already in position order."""
    ranks = [layout_spans(layout, cp_size, r, seq_len) for r in range(member * inner, (member + 1) * inner)]
    flat = [s for spans in ranks for s in spans]
    _, order = canonical_member_spans(ranks)
    if order == sorted(order):
        return None
    starts = [sum(s.count for s in flat[:i]) for i in range(len(flat))]
    forward = [(starts[i], flat[i].count) for i in order]
    new_starts = {i: sum(flat[j].count for j in order[:n]) for n, i in enumerate(order)}
    backward = [(new_starts[i], flat[i].count) for i in range(len(flat))]
    return forward, backward


def _take(x: torch.Tensor, pieces) -> torch.Tensor:
    return torch.cat([x[start:start + count] for start, count in pieces])


def context_parallel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: HCPGroups, comm: str,
                             layout: str, causal: bool, kernel: Kernel, scale: float, return_lse: bool,
                             dropout_p: float = 0.0, dropout_seed: int = 0):
    """Run scheme ``comm`` on validated local shards; returns ``out`` (and ``lse [s, b, h]``).

    Dropout masks are drawn per (seed, CP rank, ring step, task): deterministic for a given seed and
    layout, different on every rank and step."""
    cp_size, cp_rank = groups.cp_size, groups.cp_rank
    seq_len = q.shape[0] * cp_size
    inner = a2a_degree(comm, groups)
    member, ring_size = cp_rank // inner, cp_size // inner
    schedule = _schedule(layout, cp_size, seq_len, causal, inner)
    pieces = None
    if inner > 1:
        a2a_group = groups.cp_group if comm == "a2a" else groups.levels[0]
        if k.shape[2] < inner:  # fewer KV heads than ranks: each rank needs its own copy of its head
            k, v = (x.repeat_interleave(inner // k.shape[2], dim=2) for x in (k, v))
        q, k, v = (seq_to_heads(x, a2a_group) for x in (q, k, v))
        pieces = _member_pieces(layout, cp_size, seq_len, inner, member)
        if pieces is not None:
            q, k, v = (_take(x, pieces[0]) for x in (q, k, v))
    if ring_size == 1:
        rotation = LocalRotation(0, 1)
    elif comm == "all_gather":
        k, v = gather_seq(k, groups.cp_group), gather_seq(v, groups.cp_group)
        rotation = LocalRotation(member, ring_size)
    else:
        cp_ranks = groups.cp_global_ranks
        peers = [cp_ranks[cp_rank % inner + inner * m] for m in range(ring_size)]
        rotation = RingRotation(RingExchange(peers, member, groups.cp_group, "ring_kv"),
                                RingExchange(peers, member, groups.cp_group, "ring_dkv"), ring_size)
    plan = RingPlan(schedule.tasks[member], rotation, kernel, scale, dropout_p, hash((dropout_seed, cp_rank)))
    out, lse = RingAttention.apply(q, k, v, plan)
    lse = lse.permute(2, 0, 1)  # [s, b, h]
    if inner > 1:
        if pieces is not None:
            out, lse = _take(out, pieces[1]), _take(lse, pieces[1])
        out = heads_to_seq(out, a2a_group)
        if return_lse:
            lse = heads_to_seq(lse.unsqueeze(-1).contiguous(), a2a_group).squeeze(-1)
    return (out, lse) if return_lse else out
