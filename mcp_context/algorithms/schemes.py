"""The communication schemes, all as one composition: Ulysses all-to-all, then a ring.

Each scheme is a row of ``cp_rules.COMM_SCHEMES`` (which ranks share tokens by all-to-all, how K/V
then move); this module turns a row into a ``Scheme``, with ``KV_MOVES`` building the rotation:

==============  ======================  =====================================================
``comm``        all-to-all over          ring over
==============  ======================  =====================================================
p2p             (none)                  all CP ranks, KV passed point-to-point
all_gather      (none)                  all CP ranks, KV all-gathered once, in position order
a2a             all CP ranks             a ring of one (local attention over the full sequence)
a2a+p2p         level 0 (adjacent)       the product of the outer levels, point-to-point
a2a+all_gather  level 0 (adjacent)       the product of the outer levels, KV all-gathered once, in order
==============  ======================  =====================================================

After the level-0 all-to-all a rank holds its group's tokens for ``h / P0`` heads; putting them in
position order makes the group one member of a ring over ``P / P0`` members whose shards follow the
same layout (a zigzag group is a zigzag shard of the outer ring), so the outer ring runs the same
schedule code. The ring spans all outer levels flattened (member ``m`` = groups in CP-rank order);
it is driven with point-to-point sends to global ranks inside the CP group, so no extra process
group is needed for any depth. K and V move as one packed tensor (``packing``): one all-to-all, one
reorder and one all-gather for both, and in the backward one of each for dK/dV, which the executor hands
back as the columns of its packed buffer. Autograd: the all-to-alls and the all-gather are autograd-aware
primitives and the ring is one ``autograd.Function``, so their composition is differentiable.

``resolve_scheme`` works out once, for one shard shape, everything a call needs (this member's
schedule row, ring peers, all-to-all pieces, the plan); ``Scheme.run`` is the per-call part.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm import HCPGroups, RingExchange, gather_seq, heads_to_seq, seq_to_heads
from ..comm.primitives import PeerExchange, gather_seq_among
from ..cp_rules import a2a_degree, comm_rule
from ..kernels import Kernel
from ..layouts import canonical_member_spans, layout_spans
from ..masks import CAUSAL, FULL, Documents, Mask
from ..schedule import BlockTask, Schedule, gathered_tasks, layout_schedule, position_pieces
from .executor import RingAttention, RingPlan
from .halo import HaloRotation, halo_fits
from .packing import packed, unpacked
from .rotation import LocalRotation, RingRotation, Rotation


def _member_pieces(layout: str, cp_size: int, seq_len: int, inner: int, member: int,
                   documents: Optional[Documents] = None) -> Optional[tuple]:
    """``(start, count)`` row pieces of the all-to-all output, in the order that sorts them by
    position, and the inverse order; ``None`` when the output is already in position order."""
    ranks = [layout_spans(layout, cp_size, r, seq_len, documents) for r in range(member * inner, (member + 1) * inner)]
    flat = [s for spans in ranks for s in spans]
    _, order = canonical_member_spans(ranks)
    if order == sorted(order):
        return None
    starts = list(itertools.accumulate((s.count for s in flat), initial=0))
    forward = [(starts[i], flat[i].count) for i in order]
    return forward, list(_inverse(forward))


def _cat_rows(x: torch.Tensor, pieces) -> torch.Tensor:
    return torch.cat([x.narrow(0, start, count) for start, count in pieces])


def _inverse(pieces) -> tuple[tuple[int, int], ...]:
    """The pieces that undo ``pieces``: where each source run landed, in source order."""
    landed, row = [], 0
    for start, count in pieces:
        landed.append((start, row, count))
        row += count
    return tuple((r, n) for _, r, n in sorted(landed))


class _TakeRows(torch.autograd.Function):
    """Rows of ``x [s, ...]`` reordered by ``(start, count)`` pieces (a permutation of whole runs): one
    concatenation forward, one backward (autograd of slicing would add a zero-filled input-sized
    gradient per piece)."""

    @staticmethod
    def forward(ctx, x, pieces):
        ctx.pieces = pieces
        return _cat_rows(x, pieces)

    @staticmethod
    def backward(ctx, grad):
        return _cat_rows(grad, _inverse(ctx.pieces)), None


def take_rows(x: torch.Tensor, pieces) -> torch.Tensor:
    """``x``'s rows (dim 0) in the order of ``pieces``, which cover every row once; differentiable."""
    return _TakeRows.apply(x, tuple(pieces))


@dataclass(frozen=True)
class Scheme:
    """One CP rank's resolved execution of ``comm`` for shards of one shape."""

    cp_rank: int
    inner: int                              # all-to-all degree (1: no all-to-all)
    a2a_group: Optional[ProcessGroup]
    a2a_index: int                          # this rank's place in the all-to-all group: its slice of heads
    kv_repeat: int                          # KV heads copied this often before the all-to-all
    pieces: Optional[tuple]                 # all-to-all output rows -> position order, and back
    gather: Optional[Callable]              # K/V all-gathered over the ring's members first (or None)
    plan: RingPlan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool, dropout_seed: int = 0,
            sink: Optional[torch.Tensor] = None):
        """Attention over validated local shards ``q, k [s, b, h(_kv), dqk]``, ``v [s, b, h_kv, dv]``;
        ``out [s, b, h, dv]`` (and ``lse [s, b, h]``). ``sink [h]``: per-head attention sinks (after the
        all-to-all a rank computes ``h / inner`` heads and takes their slice of the sinks).

        Dropout masks are drawn per (seed, CP rank, ring step, task): deterministic for a given seed
        and layout, different on every rank and step."""
        plan = self.plan if self.plan.dropout_p == 0 else self.plan.with_dropout_seed(hash((dropout_seed,
                                                                                             self.cp_rank)))
        moved = self.inner > 1 or self.gather is not None
        if moved:  # K and V move as one packed tensor: one collective and one reorder for both
            dqk, kv = k.shape[-1], packed(k, v)
        if self.inner > 1:
            if sink is not None:
                heads = q.shape[2] // self.inner
                sink = sink[self.a2a_index * heads:(self.a2a_index + 1) * heads]
            if self.kv_repeat > 1:  # fewer KV heads than ranks: each rank needs its own copy of its head
                kv = kv.repeat_interleave(self.kv_repeat, dim=2)
            q, kv = (seq_to_heads(x, self.a2a_group) for x in (q, kv))
            if self.pieces is not None:
                q, kv = (take_rows(x, self.pieces[0]) for x in (q, kv))
        if self.gather is not None:
            kv = self.gather(kv)
        if moved:
            k, v = unpacked(kv, dqk)
        out, lse = RingAttention.apply(q, k, v, plan, sink)
        lse = lse.permute(2, 0, 1)  # [s, b, h]
        if self.inner > 1:
            if self.pieces is not None:
                out, lse = take_rows(out, self.pieces[1]), take_rows(lse, self.pieces[1])
            out = heads_to_seq(out, self.a2a_group)
            if return_lse:
                lse = heads_to_seq(lse.unsqueeze(-1).contiguous(), self.a2a_group).squeeze(-1)
        return (out, lse) if return_lse else out


Tasks = tuple[tuple[BlockTask, ...], ...]


def _ring_kv(groups: HCPGroups, schedule: Schedule, member: int, peers: list[int], kernel_masks: frozenset
             ) -> tuple[Rotation, Optional[Callable], Tasks]:
    """K/V passed point-to-point step by step (only the rows read, from their owner, when a window's or
    the documents' halo fits: ``HaloRotation``)."""
    tasks = schedule.member_tasks(member)
    if schedule.ring_size == 1:
        return LocalRotation(0, 1), None, tasks
    if schedule.mask not in (FULL, CAUSAL) and halo_fits(schedule):  # a window, documents: only rows read
        connect = functools.partial(PeerExchange, group=groups.cp_group)
        return HaloRotation(schedule, member, peers, connect), None, tasks
    size = schedule.ring_size
    return RingRotation(RingExchange(peers, member, groups.cp_group, "ring_kv"),
                        RingExchange(peers, member, groups.cp_group, "ring_dkv"), size,
                        steps=max(schedule.busy_steps(), default=0) + 1), None, tasks  # none reads after the last


def _gathered_kv(groups: HCPGroups, schedule: Schedule, member: int, peers: list[int], kernel_masks: frozenset
                 ) -> tuple[Rotation, Optional[Callable], Tasks]:
    """K/V all-gathered once over the ring's members (a collective over the whole CP group; among the
    outer members of a hierarchy, point-to-point) and put in position order, so each query run meets
    its visible keys in one call (``schedule.gathered_tasks``); a strided layout keeps member order and
    walks the gathered shards step by step."""
    if schedule.ring_size == 1:
        return LocalRotation(0, 1), None, schedule.member_tasks(member)
    if len(peers) == groups.cp_size:
        gather = functools.partial(gather_seq, group=groups.cp_group)
    else:
        gather = functools.partial(gather_seq_among, peers=peers, me=member, group=groups.cp_group)
    order = position_pieces(schedule)
    tasks = member_tasks("gather", schedule, member, kernel_masks)
    if order is None:
        return LocalRotation(member, len(peers)), gather, tasks
    return LocalRotation(0, 1), lambda x: take_rows(gather(x), order), tasks


KV_MOVES = {"ring": _ring_kv, "gather": _gathered_kv}
"""How K/V reach the ring's members, by ``CommRule.kv``: each builds the rotation, the gather (if any) and
the member's tasks against what the rotation hands out (``member_tasks``)."""


def member_tasks(kv: str, schedule: Schedule, member: int, kernel_masks: frozenset) -> Tasks:
    """The block tasks ``member`` runs when K/V move by ``kv`` (``CommRule.kv``): its schedule row, or, where
    K/V are gathered over a ring of several and a layout can be put in position order, one step against the
    whole sequence (``schedule.gathered_tasks``). Needs no process group: the planner counts a candidate's
    calls from it before deciding whether to dry-run it."""
    if kv == "gather" and schedule.ring_size > 1 and position_pieces(schedule) is not None:
        return gathered_tasks(schedule, member, kernel_masks)
    return schedule.member_tasks(member)


def resolve_scheme(groups: HCPGroups, comm: str, layout: str, mask: Mask, s_local: int, kv_heads: int,
                   kernel: Kernel, scale: float, dropout_p: float = 0.0) -> Scheme:
    """Everything this CP rank needs to run ``comm`` on ``[s_local, b, h, d]`` shards, worked out once.

    ``mask``: a ``masks`` value; the schedule splits it into block masks ``kernel`` computes natively.
    With ``Documents`` the layout places the packed documents, and the schedule skips every pair across
    a document boundary. The scheme is what the rule of ``comm`` composes (``cp_rules.COMM_SCHEMES``):
    an all-to-all over ``a2a_degree`` adjacent ranks, then K/V moved by ``KV_MOVES[rule.kv]``."""
    rule = comm_rule(comm)
    cp_size, cp_rank = groups.cp_size, groups.cp_rank
    seq_len = s_local * cp_size
    inner = a2a_degree(comm, groups.sizes)
    member, ring_size = cp_rank // inner, cp_size // inner
    documents = mask if isinstance(mask, Documents) else None
    schedule = layout_schedule(layout, cp_size, seq_len, mask, inner, kernel.capabilities.masks)
    a2a_group = pieces = None
    a2a_index = 0
    if inner > 1:
        a2a_group = groups.cp_group if inner == cp_size else groups.inner_group
        a2a_index = dist.get_rank(a2a_group)
        pieces = _member_pieces(layout, cp_size, seq_len, inner, member, documents)
    cp_ranks = groups.cp_global_ranks
    peers = [cp_ranks[cp_rank % inner + inner * m] for m in range(ring_size)]
    rotation, gather, tasks = KV_MOVES[rule.kv](groups, schedule, member, peers, kernel.capabilities.masks)
    plan = RingPlan.build(tasks, rotation, kernel, scale, s_local * inner, dropout_p)
    kv_repeat = inner // kv_heads if kv_heads < inner else 1
    return Scheme(cp_rank, inner, a2a_group, a2a_index, kv_repeat, pieces, gather, plan)
