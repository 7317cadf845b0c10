"""The ring schedule as data: for each ring member and ring step, which block tasks to compute.

A ring of ``P`` members passes key/value shards around: at step ``t`` member ``m`` holds the shard of
member ``(m - t) mod P``. For each step the schedule lists ``BlockTask``s — a range of local query
rows against a range of the arriving shard's rows, with one of the two masks every kernel supports
(``full``, or ``causal`` on a square block). Pairs that are masked out are simply absent: this is
where causal-block skipping happens (a contiguous layout skips whole future steps; zigzag turns every
off-diagonal step into half a block; striped needs a strictly-causal block, i.e. a causal block with
one query row dropped).

Tasks are derived, not hand-written: every shard is a list of ``Span``s (arithmetic progressions of
positions), and for a query span and key span of equal stride the visible pairs are exactly
``j <= i + off`` with ``off = floor((q.start - k.start) / stride)``. One formula covers every layout;
a sliding window or document mask would be a second bound in ``_span_pair_tasks``.

Nothing here touches tensors: tests and the planner count FLOPs, balance and waste from the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .layouts import Span, canonical_member_spans, layout_spans


@dataclass(frozen=True)
class BlockTask:
    """Query rows ``q`` of the local shard against rows ``kv`` of the arriving key/value shard.

    ``causal=True`` means a square block where query row ``i`` sees key rows ``0..i``.
    """

    q: tuple[int, int]
    kv: tuple[int, int]
    causal: bool

    @property
    def useful_pairs(self) -> int:
        n = self.q[1] - self.q[0]
        return n * (n + 1) // 2 if self.causal else n * (self.kv[1] - self.kv[0])

    def computed_pairs(self, tile: int) -> int:
        """Pairs a tiled kernel computes: whole ``tile x tile`` tiles touching the visible region."""
        if not self.causal:
            return self.useful_pairs
        n = self.q[1] - self.q[0]
        return sum(min(tile, n - a) * min(a + tile, n) for a in range(0, n, tile))


@dataclass(frozen=True)
class Schedule:
    """Per ring member and ring step, the tasks that member computes (``tasks[member][step]``)."""

    member_spans: tuple[tuple[Span, ...], ...]
    causal: bool
    tasks: tuple[tuple[tuple[BlockTask, ...], ...], ...]

    @property
    def ring_size(self) -> int:
        return len(self.member_spans)

    def kv_source(self, member: int, step: int) -> int:
        """Whose key/value shard ``member`` holds at ring ``step``."""
        return (member - step) % self.ring_size

    def useful_pairs(self) -> list[int]:
        """Visible (query, key) pairs each member computes, summed over steps."""
        return [sum(t.useful_pairs for step in member for t in step) for member in self.tasks]

    def computed_pairs(self, tile: int = 128) -> list[int]:
        return [sum(t.computed_pairs(tile) for step in member for t in step) for member in self.tasks]


def _span_pair_tasks(qs: Span, qo: int, ks: Span, ko: int, causal: bool) -> list[BlockTask]:
    """Tasks for query span ``qs`` (local rows from ``qo``) against key span ``ks`` (rows from ``ko``)."""
    n, m = qs.count, ks.count
    if not causal:
        return [BlockTask((qo, qo + n), (ko, ko + m), False)]
    if qs.stride != ks.stride:
        raise ValueError(f"cannot derive a causal mask between spans of strides {qs.stride} and {ks.stride}")
    off = (qs.start - ks.start) // qs.stride  # query row i sees key rows j <= i + off
    if off >= m - 1:
        return [BlockTask((qo, qo + n), (ko, ko + m), False)]
    if off <= -n:
        return []
    r0, c0 = max(0, -off), max(0, off)  # first query row with a visible key; first key on the diagonal
    side = min(n - r0, m - c0)
    tasks = [BlockTask((qo + r0, qo + r0 + side), (ko + c0, ko + c0 + side), True)]
    if c0 > 0:  # keys before the diagonal: every row sees them
        tasks.append(BlockTask((qo, qo + n), (ko, ko + c0), False))
    if r0 + side < n:  # rows past the last key: they see the diagonal's keys in full
        tasks.append(BlockTask((qo + r0 + side, qo + n), (ko + c0, ko + m), False))
    return tasks


def _is_one_causal_block(q_spans: Sequence[Span], kv_spans: Sequence[Span]) -> bool:
    """True when the whole step is one causal square in local coordinates (a member against itself
    with its positions in increasing order: key row j is visible to query row i iff j <= i)."""
    return q_spans == kv_spans and all(a.last < b.start for a, b in zip(q_spans, q_spans[1:]))


def _fuse_full_tasks(tasks: list[BlockTask]) -> list[BlockTask]:
    """Fuse full tasks that share a query range and abut in keys (or the reverse): fewer, larger calls."""
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(tasks):
            for j, b in enumerate(tasks):
                if i == j or a.causal or b.causal:
                    continue
                if a.q == b.q and a.kv[1] == b.kv[0]:
                    fused = BlockTask(a.q, (a.kv[0], b.kv[1]), False)
                elif a.kv == b.kv and a.q[1] == b.q[0]:
                    fused = BlockTask((a.q[0], b.q[1]), a.kv, False)
                else:
                    continue
                tasks = [t for k, t in enumerate(tasks) if k not in (i, j)] + [fused]
                changed = True
                break
            if changed:
                break
    return sorted(tasks, key=lambda t: (t.q, t.kv))


def step_tasks(q_spans: Sequence[Span], kv_spans: Sequence[Span], causal: bool) -> tuple[BlockTask, ...]:
    """The tasks for one member's query spans against one arriving key/value shard."""
    nq, nk = sum(s.count for s in q_spans), sum(s.count for s in kv_spans)
    if not causal:
        return (BlockTask((0, nq), (0, nk), False),)
    if _is_one_causal_block(q_spans, kv_spans):
        return (BlockTask((0, nq), (0, nk), True),)
    tasks: list[BlockTask] = []
    qo = 0
    for qs in q_spans:
        ko = 0
        for ks in kv_spans:
            tasks += _span_pair_tasks(qs, qo, ks, ko, causal)
            ko += ks.count
        qo += qs.count
    return tuple(_fuse_full_tasks(tasks))


def build_schedule(member_spans: Sequence[Sequence[Span]], causal: bool) -> Schedule:
    """The ring schedule for members holding ``member_spans`` (member m receives from m-1)."""
    size = len(member_spans)
    tasks = tuple(
        tuple(step_tasks(member_spans[m], member_spans[(m - t) % size], causal) for t in range(size))
        for m in range(size)
    )
    return Schedule(tuple(tuple(s) for s in member_spans), causal, tasks)


def layout_schedule(layout: str, cp_size: int, seq_len: int, causal: bool, inner_size: int = 1) -> Schedule:
    """The schedule of a ring over groups of ``inner_size`` adjacent CP ranks (1: the flat ring).

    With ``inner_size > 1`` a member is a level-0 all-to-all group whose tokens were gathered and
    put in position order (``canonical_member_spans``); ``inner_size == cp_size`` is plain Ulysses.
    """
    ranks = [layout_spans(layout, cp_size, r, seq_len) for r in range(cp_size)]
    members = [canonical_member_spans(ranks[g:g + inner_size])[0] for g in range(0, cp_size, inner_size)]
    return build_schedule(members, causal)


def load_balance(schedule: Schedule) -> float:
    """Max over ring members of attention FLOPs divided by the mean (1.0 is perfect)."""
    pairs = schedule.useful_pairs()
    return max(pairs) * len(pairs) / sum(pairs)


def masked_waste(schedule: Schedule, tile: int = 128) -> float:
    """FLOPs a kernel with ``tile``-sized tiles spends on masked pairs, divided by useful FLOPs."""
    useful, computed = sum(schedule.useful_pairs()), sum(schedule.computed_pairs(tile))
    return (computed - useful) / useful


def attention_flops(schedule: Schedule, batch: int, heads: int, head_dim: int) -> list[int]:
    """Forward attention FLOPs per member (``4 * d`` per visible pair and head: QK^T and PV)."""
    return [4 * p * batch * heads * head_dim for p in schedule.useful_pairs()]
