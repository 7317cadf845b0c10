"""The ring schedule as data: for each ring member and ring step, which block tasks to compute.

A ring of ``P`` members passes key/value shards around: at step ``t`` member ``m`` holds the shard of
member ``(m - t) mod P``. For each step the schedule lists ``BlockTask``s — a range of local query
rows against a range of the arriving shard's rows, with a block mask (``masks.BlockMask``) the
chosen kernel computes natively. Pairs that are masked out are simply absent: this is where skipping
happens (a contiguous causal layout skips whole future steps; zigzag turns every off-diagonal step
into half a block; a sliding window empties every step whose keys are out of reach of every query).

Tasks are derived, not hand-written: every shard is a list of ``Span``s (arithmetic progressions of
positions); the mask turns a query span against a key span into rectangles of local rows, each with
one band ``lo <= b - a <= hi`` (``Mask.span_blocks``), and ``_pieces`` cuts a banded rectangle into
full blocks, causal squares (the band's upper edge), anticausal squares (its lower edge) and, for a
kernel that applies a band itself, band blocks; a band narrower than its rectangle becomes two
*diagonal runs* (equal squares along a diagonal, one task each, ``BlockMask.diagonal``) so a narrow
window costs a few kernel calls per step, not one per square; for a kernel without a kind it halves
the rectangle until the pieces are kinds it has. One formula covers every layout and every mask.

Nothing here touches tensors: tests and the planner count FLOPs, balance and waste from the schedule.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from .layouts import Span, canonical_member_spans, forget_kept_packings, layout_spans
from .masks import (BLOCK_MASK_KINDS, CAUSAL, CAUSAL_BLOCK, FULL, FULL_BLOCK, BlockMask, Documents, Mask, as_mask,
                    block_mask, documents_mask)

ALL_BLOCK_MASKS = frozenset(BLOCK_MASK_KINDS)
SCHEDULES_KEPT = 64
"""How many schedules ``layout_schedule`` keeps, by its arguments (masks without documents only)."""

RUN_ROWS = 2048
"""Most query rows in one task of a diagonal run (unless one square is larger). A fused op runs a
task as one call whose copies (the flipped rows of an anticausal run, the call's output and
gradients) grow with its rows: 2048 keeps a window's peak memory at that of the square-by-square
cut (the planner's dry run at 128K over P = 8) while a narrow window still costs a few calls per step."""


@dataclass(frozen=True)
class BlockTask:
    """Query rows ``q`` of the local shard against rows ``kv`` of the arriving key/value shard, with
    block mask ``mask`` in the block's own rows (``True``/``False`` are accepted for causal/full)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mask: BlockMask = FULL_BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask", block_mask(self.mask))

    @property
    def causal(self) -> bool:
        """A causal square (query row ``i`` sees key rows ``0..i``), or a diagonal run of them."""
        return self.mask.kind == "causal"

    @property
    def useful_pairs(self) -> int:
        return self.mask.pairs(self.q[1] - self.q[0], self.kv[1] - self.kv[0])

    def computed_pairs(self, tile: int) -> int:
        """Pairs a tiled kernel computes: whole ``tile x tile`` tiles touching the visible region."""
        return self.mask.computed_pairs(self.q[1] - self.q[0], self.kv[1] - self.kv[0], tile)


@dataclass(frozen=True)
class Schedule:
    """Per ring member and ring step, the tasks that member computes (``tasks[member][step]``).

    Built lazily: a rank runs one member's row (``member_tasks``) and needs of the others only which rows
    they read (``kv_rows``, which does not cut the rectangles into tasks), so a packed batch's schedule,
    new at every step, costs a rank its own row, not the ring's ``P x P`` steps. ``tasks`` builds every row
    (the planner's figures, the self-test)."""

    member_spans: tuple[tuple[Span, ...], ...]
    mask: Mask
    kernel_masks: frozenset = ALL_BLOCK_MASKS

    @functools.cached_property
    def _rows(self) -> dict[int, tuple[tuple[BlockTask, ...], ...]]:
        return {}  # member -> its tasks per step, as asked

    @functools.cached_property
    def _kv_rows(self) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
        return {}  # (member, step) -> the rows it reads, as asked

    def member_tasks(self, member: int) -> tuple[tuple[BlockTask, ...], ...]:
        """``member``'s tasks at each ring step (built on the first ask, then kept)."""
        row = self._rows.get(member)
        if row is None:
            spans, size = self.member_spans, self.ring_size
            row = self._rows[member] = tuple(step_tasks(spans[member], spans[(member - t) % size], self.mask,
                                                        self.kernel_masks) for t in range(size))
        return row

    @functools.cached_property
    def tasks(self) -> tuple[tuple[tuple[BlockTask, ...], ...], ...]:
        return tuple(self.member_tasks(m) for m in range(self.ring_size))

    @property
    def causal(self) -> bool:
        """No query sees a later key (causal, or a window with ``right == 0``)."""
        return self.mask.hides_future

    @property
    def ring_size(self) -> int:
        return len(self.member_spans)

    def kv_source(self, member: int, step: int) -> int:
        """Whose key/value shard ``member`` holds at ring ``step``."""
        return (member - step) % self.ring_size

    def kv_rows(self, member: int, step: int) -> tuple[tuple[int, int], ...]:
        """Rows of the arriving shard that ``member``'s tasks at ``step`` read, as sorted disjoint
        ``[start, stop)`` ranges: all a transfer must bring (nothing for a step without tasks). Derived from the
        mask's rectangles (``step_kv_ranges``: the rows the tasks read, without cutting them), kept."""
        kept = self._kv_rows.get((member, step))
        if kept is None:
            spans = self.member_spans
            ranges = step_kv_ranges(spans[member], spans[(member - step) % self.ring_size], self.mask)
            kept = self._kv_rows[(member, step)] = tuple(merged_ranges(ranges))
        return kept

    def busy_steps(self) -> list[int]:
        """Ring steps at which some member has a task (a ring walks up to the last of them)."""
        return [t for t in range(self.ring_size) if any(self.kv_rows(m, t) for m in range(self.ring_size))]

    def useful_pairs(self) -> list[int]:
        """Visible (query, key) pairs each member computes, summed over steps."""
        return [sum(t.useful_pairs for step in member for t in step) for member in self.tasks]

    def computed_pairs(self, tile: int = 128) -> list[int]:
        return [sum(t.computed_pairs(tile) for step in member for t in step) for member in self.tasks]


def merged_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges sorted, with those that overlap or touch merged into one."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _visible(n: int, m: int, lo: Optional[int], hi: Optional[int]) -> Optional[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)``: the rows of an ``n x m`` rectangle with band ``lo <= b - a <= hi`` that see a key,
    and the keys some row sees (each a contiguous range); None when no pair is visible."""
    r0, r1 = (0 if hi is None else max(0, -hi)), (n if lo is None else min(n, m - lo))
    c0, c1 = (0 if lo is None else max(0, lo)), (m if hi is None else min(m, n + hi))
    if r0 >= r1 or c0 >= c1 or (lo is not None and hi is not None and lo > hi):
        return None
    return r0, r1, c0, c1


def _pieces(q0: int, q1: int, k0: int, k1: int, lo: Optional[int], hi: Optional[int],
            native: frozenset) -> list[BlockTask]:
    """Tasks covering exactly the pairs of query rows ``[q0, q1)`` and key rows ``[k0, k1)`` with
    ``lo <= (b - k0) - (a - q0) <= hi``, each with a block mask whose kind is in ``native``."""
    n, m = q1 - q0, k1 - k0
    visible = _visible(n, m, lo, hi)
    if visible is None:
        return []
    r0, r1, c0, c1 = visible
    shift = c0 - r0
    q0, k0, n, m = q0 + r0, k0 + c0, r1 - r0, c1 - c0
    lo = None if lo is None or lo - shift <= -(n - 1) else lo - shift
    hi = None if hi is None or hi - shift >= m - 1 else hi - shift
    mask = BlockMask(lo, hi)
    if mask.kind == "full" or (mask.kind in native and (mask.kind == "band" or n == m)):
        return [BlockTask((q0, q0 + n), (k0, k0 + m), mask)]
    if lo is None and "causal" in native:  # upper edge only (hi >= 0): keys before it, a square, rows below
        if hi > 0:
            return [BlockTask((q0, q0 + n), (k0, k0 + hi))] + _pieces(q0, q0 + n, k0 + hi, k0 + m, None, 0, native)
        return _pieces(q0, q0 + m, k0, k0 + m, None, 0, native) + [BlockTask((q0 + m, q0 + n), (k0, k0 + m))]
    if hi is None and "anticausal" in native:  # lower edge only (lo <= 0): rows above it, a square, keys after
        if lo < 0:
            return [BlockTask((q0, q0 - lo), (k0, k0 + m))] + _pieces(q0 - lo, q0 + n, k0, k0 + m, 0, None, native)
        return _pieces(q0, q0 + n, k0, k0 + n, 0, None, native) + [BlockTask((q0, q0 + n), (k0 + n, k0 + m))]
    if lo is not None and hi is not None and {"causal", "anticausal"} <= native:  # both edges (lo <= 0 <= hi)
        runs = _band_runs(q0, n, k0, m, lo, hi, native)
        if runs is not None:
            return runs
        w = hi - lo + 1  # rows of the band's width: keys up to hi have only the lower edge, the rest the upper
        if n > w:
            return _pieces(q0, q0 + w, k0, k0 + m, lo, hi, native) + _pieces(q0 + w, q0 + n, k0, k0 + m, lo + w,
                                                                              hi + w, native)
        return (_pieces(q0, q0 + n, k0, k0 + hi + 1, lo, None, native)
                + _pieces(q0, q0 + n, k0 + hi + 1, k0 + m, lo - hi - 1, -1, native))
    if n >= m:  # a kind this kernel lacks: halve the longer side until the pieces are kinds it has
        h = n // 2
        return (_pieces(q0, q0 + h, k0, k0 + m, lo, hi, native)
                + _pieces(q0 + h, q0 + n, k0, k0 + m, _add(lo, h), _add(hi, h), native))
    h = m // 2
    return (_pieces(q0, q0 + n, k0, k0 + h, lo, hi, native)
            + _pieces(q0, q0 + n, k0 + h, k0 + m, _add(lo, -h), _add(hi, -h), native))


def _band_runs(q0: int, n: int, k0: int, m: int, lo: int, hi: int, native: frozenset) -> Optional[list[BlockTask]]:
    """A band narrower than its rectangle as two diagonal runs, or None when it holds fewer than two.

    Rows ``a`` whose keys ``a + lo .. a + hi`` all lie in the rectangle, cut into groups of
    ``g = hi - lo`` rows (the band's width less one; 1 for a one-key band), see exactly: an
    anticausal ``g x g`` square per group (keys from ``a + lo``, the band's lower edge) and a causal
    ``g x g`` square per group (keys from ``a + hi``, its upper edge). Consecutive groups' squares are
    consecutive in rows and in keys, so each family is one task per ``RUN_ROWS`` rows,
    ``BlockMask(..., diagonal=groups)``, that a fused op runs as one batched call: about
    ``2 n / RUN_ROWS`` tasks for the band instead of about ``4 n / w``.
    The few rows above and below (where the band leaves the rectangle) are cut as before."""
    g = max(hi - lo, 1)
    a0, a1 = max(0, -lo), min(n, m - hi)  # rows whose whole band is inside the rectangle
    groups = (a1 - a0) // g
    if groups < 2:
        return None
    end, per_task = a0 + groups * g, max(1, RUN_ROWS // g)
    runs = []
    for first in range(0, groups, per_task):  # a run's tasks: RUN_ROWS rows at most (or one group)
        n_groups = min(per_task, groups - first)
        a, rows = a0 + first * g, n_groups * g
        q = (q0 + a, q0 + a + rows)
        if hi > lo:  # a one-key band has no lower-edge part
            runs.append(BlockTask(q, (k0 + a + lo, k0 + a + lo + rows), BlockMask(0, None, n_groups)))
        runs.append(BlockTask(q, (k0 + a + hi, k0 + a + hi + rows), BlockMask(None, 0, n_groups)))
    return (_pieces(q0, q0 + a0, k0, k0 + m, lo, hi, native) + runs
            + _pieces(q0 + end, q0 + n, k0, k0 + m, lo + end, hi + end, native))


def _add(x: Optional[int], d: int) -> Optional[int]:
    return None if x is None else x + d


def _is_one_causal_block(q_spans: Sequence[Span], kv_spans: Sequence[Span]) -> bool:
    """True when the whole step is one causal square in local coordinates (a member against itself
    with its positions in increasing order: key row j is visible to query row i iff j <= i)."""
    return q_spans == kv_spans and all(a.last < b.start for a, b in zip(q_spans, q_spans[1:]))


def _fuse_full_tasks(tasks: list[BlockTask]) -> list[BlockTask]:
    """Fuse full tasks that share a query range and abut in keys (or the reverse): fewer, larger calls.

    Pairs fuse one at a time, always the first task (in list order) that has a partner with the
    first such partner, the fused task going last; partners are looked up by their ranges, so a
    step of ``n`` tasks costs O(n) per fusion, not O(n^2)."""
    while True:
        starts_at: dict[tuple, int] = {}  # (q, kv start) / (kv, q start) of each full task -> first index
        for j, b in enumerate(tasks):
            if b.mask == FULL_BLOCK:
                starts_at.setdefault(("kv", b.q, b.kv[0]), j)
                starts_at.setdefault(("q", b.kv, b.q[0]), j)
        for i, a in enumerate(tasks):
            if a.mask != FULL_BLOCK:
                continue
            partners = [j for j in (starts_at.get(("kv", a.q, a.kv[1])), starts_at.get(("q", a.kv, a.q[1])))
                        if j is not None and j != i]
            if partners:
                j = min(partners)
                b = tasks[j]
                fused = (BlockTask(a.q, (a.kv[0], b.kv[1])) if a.q == b.q else BlockTask((a.q[0], b.q[1]), a.kv))
                tasks = [t for k, t in enumerate(tasks) if k not in (i, j)] + [fused]
                break
        else:
            return sorted(tasks, key=lambda t: (t.q, t.kv))


def step_tasks(q_spans: Sequence[Span], kv_spans: Sequence[Span], mask: Mask,
               kernel_masks: frozenset = ALL_BLOCK_MASKS) -> tuple[BlockTask, ...]:
    """The tasks for one member's query spans against one arriving key/value shard, with block masks
    whose kinds are in ``kernel_masks`` (what the kernel computes natively)."""
    mask = as_mask(mask)
    nq, nk = sum(s.count for s in q_spans), sum(s.count for s in kv_spans)
    if mask == FULL:
        return (BlockTask((0, nq), (0, nk)),)
    if mask == CAUSAL and _is_one_causal_block(q_spans, kv_spans):
        return (BlockTask((0, nq), (0, nk), CAUSAL_BLOCK),)
    tasks: list[BlockTask] = []
    for group in mask.blocks(q_spans, kv_spans):  # full pieces fuse within a group (a document)
        tasks += _fuse_full_tasks([t for a0, a1, b0, b1, block in group
                                   for t in _pieces(a0, a1, b0, b1, block.lo, block.hi, kernel_masks)])
    return tuple(sorted(tasks, key=lambda t: (t.q, t.kv)))


def step_kv_ranges(q_spans: Sequence[Span], kv_spans: Sequence[Span], mask: Mask) -> list[tuple[int, int]]:
    """The key row ranges ``step_tasks`` would read for these spans (overlapping, unsorted), without cutting
    the rectangles into tasks: per rectangle, the keys some row sees."""
    mask = as_mask(mask)
    nq, nk = sum(s.count for s in q_spans), sum(s.count for s in kv_spans)
    if mask == FULL or (mask == CAUSAL and _is_one_causal_block(q_spans, kv_spans)):
        return [(0, nk)] if nq and nk else []
    ranges = []
    for group in mask.blocks(q_spans, kv_spans):
        for a0, a1, b0, b1, block in group:
            visible = _visible(a1 - a0, b1 - b0, block.lo, block.hi)
            if visible is not None:
                ranges.append((b0 + visible[2], b0 + visible[3]))
    return ranges


def build_schedule(member_spans: Sequence[Sequence[Span]], mask: Mask,
                   kernel_masks: frozenset = ALL_BLOCK_MASKS) -> Schedule:
    """The ring schedule for members holding ``member_spans`` (member m receives from m-1); its tasks are
    built as they are asked for."""
    return Schedule(tuple(tuple(s) for s in member_spans), as_mask(mask), kernel_masks)


def layout_schedule(layout: str, cp_size: int, seq_len: int, mask: Mask, inner_size: int = 1,
                    kernel_masks: frozenset = ALL_BLOCK_MASKS) -> Schedule:
    """The schedule of a ring over groups of ``inner_size`` adjacent CP ranks (1: the flat ring).

    ``mask``: a ``masks`` value, or a bool (causal/full); with ``Documents`` the layout places the
    documents (``layouts.layout_spans``). ``kernel_masks``: the block-mask kinds the
    kernel computes natively (its ``Capabilities.masks``; default: all, as the math kernel).
    With ``inner_size > 1`` a member is a level-0 all-to-all group whose tokens were gathered and
    put in position order (``canonical_member_spans``); ``inner_size == cp_size`` is plain Ulysses.

    The schedules of masks without documents are kept (``_kept_schedule``): a planner's dry run asks for one per
    rank it runs, and each member's tasks are cut once. A packed batch's documents are new at every step, so
    its schedule is built each time and not kept, and a rank cuts from it only its own member's tasks
    (``Schedule``: at 4K over 8 ranks with 30 documents, 2492 tasks for the ring, 318 for one member).
    """
    if isinstance(mask, Documents):
        return _build_layout_schedule(layout, cp_size, seq_len, mask, inner_size, kernel_masks)
    return _kept_schedule(layout, cp_size, seq_len, mask, inner_size, kernel_masks)


def forget_kept_schedules() -> None:
    """Drop the kept schedules (``layout_schedule``) and packings' spans (``layouts.forget_kept_packings``): for
    code that changes how layouts resolve at run time, the self-test's planted faults."""
    _kept_schedule.cache_clear()
    forget_kept_packings()


def _build_layout_schedule(layout: str, cp_size: int, seq_len: int, mask: Mask, inner_size: int,
                           kernel_masks: frozenset) -> Schedule:
    documents = mask if isinstance(mask, Documents) else None
    ranks = [layout_spans(layout, cp_size, r, seq_len, documents) for r in range(cp_size)]
    members = [canonical_member_spans(ranks[g:g + inner_size])[0] for g in range(0, cp_size, inner_size)]
    return build_schedule(members, mask, kernel_masks)


_kept_schedule = functools.lru_cache(maxsize=SCHEDULES_KEPT)(_build_layout_schedule)


def position_pieces(schedule: Schedule) -> Optional[tuple[tuple[int, int], ...]]:
    """``(row, count)`` pieces of every member's shard laid end to end in member order (what an all-gather
    gives) that, concatenated in this order, put the rows in position order; ``None`` when a shard holds
    a strided span (``striped``), whose rows are not runs of positions."""
    pieces, row = [], 0
    for spans in schedule.member_spans:
        for span in spans:
            if span.stride != 1 and span.count > 1:
                return None
            pieces.append((span.start, row, span.count))
            row += span.count
    return tuple((r, n) for _, r, n in sorted(pieces))


def gathered_tasks(schedule: Schedule, member: int, kernel_masks: frozenset = ALL_BLOCK_MASKS
                   ) -> tuple[tuple[BlockTask, ...]]:
    """``member``'s tasks, as one step, against every key/value row of the sequence in position order
    (K/V all-gathered and put in order, ``position_pieces``): each query span meets its visible key range
    as one run, so a causal zigzag shard is a full block per chunk over all earlier keys plus the chunk's
    causal square, full blocks fused where they abut (3 or 4 calls for any ring size, no ring steps)."""
    seq_len = sum(s.count for spans in schedule.member_spans for s in spans)
    return (step_tasks(schedule.member_spans[member], (Span(0, seq_len),), schedule.mask, kernel_masks),)


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


def packed_offsets(lengths: Sequence[int], cp_size: int, layout: str) -> tuple[list[int], list[int]]:
    """``(cu_seqlens, cu_seqlens_padded)`` for documents of ``lengths`` packed under ``layout``: every
    document padded to a multiple of ``2 * cp_size`` for ``zigzag`` (Megatron/TE), only the tail to a
    multiple of ``cp_size`` otherwise."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if layout == "zigzag":
        padded = [0]
        for n in lengths:
            padded.append(padded[-1] + n + (-n % (2 * cp_size)))
        return cu, padded
    return cu, cu[:-1] + [cu[-1] + (-cu[-1] % cp_size)]


def packed_figures(lengths: Sequence[int], cp_size: int, layout: str) -> dict[str, float]:
    """What a packed layout costs for documents of ``lengths`` packed into one sequence, from the schedule.

    ``layout="zigzag"`` pads every document to a multiple of ``2 * cp_size`` (Megatron/TE's per-document
    zigzag); ``"balanced"`` pads only the sequence's tail to a multiple of ``cp_size``. Returns
    ``balance`` (``load_balance``: max over ranks of causal pairs / mean), ``padding`` (rows added /
    document rows), ``rows_read`` (max over ranks of the K/V rows its tasks read from other ranks'
    shards: what the halo rotation moves per walk) and ``ring_rows`` (``(P - 1) * S / P``: what the
    ring moves per walk)."""
    cu, padded = packed_offsets(lengths, cp_size, layout)
    sch = layout_schedule(layout, cp_size, padded[-1], documents_mask(cu, padded), 1)
    rows_read = max(sum(b - a for t in range(1, cp_size) for a, b in sch.kv_rows(m, t)) for m in range(cp_size))
    return {"balance": load_balance(sch), "padding": (padded[-1] - cu[-1]) / cu[-1], "rows_read": rows_read,
            "ring_rows": (cp_size - 1) * padded[-1] // cp_size}
