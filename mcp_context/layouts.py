"""Which global token positions each context-parallel rank holds, and moving tensors accordingly.

A rank's shard is a list of ``Span``s (arithmetic progressions of positions, each occupying
consecutive local rows):

- ``contiguous``: rank r holds ``[r*n, (r+1)*n)``, ``n = S/P``.
- ``zigzag``: the sequence is cut into ``2P`` chunks; rank r holds chunks ``r`` and ``2P-1-r``
  (the Megatron/TE convention: identical to megatron-core's ``get_batch_on_this_cp_rank``). Every
  rank then does the same causal work.
- ``striped``: rank r holds positions ``r, r+P, r+2P, ...`` (Striped Attention).

Position ids for RoPE must follow the tokens: ``shard_positions`` gives them.

Packed sequences (``cu_seqlens``: documents, Megatron/TE ``thd``) have two layouts of their own:

- ``zigzag`` with ``cu_seqlens``: Megatron/TE's per-document zigzag — every document (its padded
  length a multiple of ``2P``) is cut into ``2P`` chunks and rank r holds chunks ``r`` and ``2P-1-r``
  of each, in document order (what TE's ``thd_get_partitioned_indices`` gives).
- ``balanced``: no per-document padding. A document whose causal work is large is cut zigzag-style
  into ``P`` pairs of equal chunks (one pair per rank, equal work); the rest of it (fewer than ``2P``
  rows) and every other document are placed whole, heaviest first, on the rank with the least work
  that still has room, a piece cut off where a rank fills up (every rank holds exactly ``S/P`` rows).
  The share of documents cut is lowered until the work is balanced (``_balanced_ranges``).

With documents, ``shard_positions`` gives RoPE positions that restart at 0 in every document
(``shard_index`` gives the rows' places in the packed sequence).
"""
from __future__ import annotations

import bisect
import functools
import heapq
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .cp_rules import check_layout, check_seq_len, document_multiple
from .masks import Documents, documents_mask


@dataclass(frozen=True)
class Span:
    """Positions ``start, start+stride, ...`` (``count`` of them), stored in consecutive local rows."""

    start: int
    count: int
    stride: int = 1

    @property
    def last(self) -> int:
        return self.start + (self.count - 1) * self.stride

    def positions(self) -> torch.Tensor:
        return torch.arange(self.count) * self.stride + self.start


def layout_spans(layout: str, cp_size: int, cp_rank: int, seq_len: int, documents: Optional[Documents] = None
                 ) -> list[Span]:
    """The spans rank ``cp_rank`` holds, in local order (``documents``: a packed sequence's documents)."""
    check_layout(layout, packed=documents is not None)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp_size}) for cp_size={cp_size}")
    if documents is not None and cp_size == 1:  # one rank holds every document, in order
        return [Span(0, seq_len)]
    if documents is not None and layout in ("zigzag", "balanced"):
        if documents.seq_len != seq_len:
            raise ValueError(f"the documents end at {documents.seq_len} but the sequence has {seq_len} rows; the "
                             f"last (padded) offset must be the sequence length")
        return list(_packed_spans(layout, cp_size, documents.starts, documents.lengths)[cp_rank])
    check_seq_len(seq_len, cp_size, layout)
    if layout == "contiguous":
        n = seq_len // cp_size
        return [Span(cp_rank * n, n)]
    if layout == "zigzag":
        c = seq_len // (2 * cp_size)
        return [Span(cp_rank * c, c), Span((2 * cp_size - 1 - cp_rank) * c, c)]
    return [Span(cp_rank, seq_len // cp_size, cp_size)]


PACKINGS_KEPT = 8
"""Packings whose spans ``_packed_spans`` keeps (a batch's documents are asked for by every rank of its scheme
and for every tensor sharded; a few batches may be in flight, as with dynamic CP's sub-samples)."""


def forget_kept_packings() -> None:
    """Drop the packings' spans ``_packed_spans`` keeps (``schedule.forget_kept_schedules`` calls it)."""
    _packed_spans.cache_clear()


def _split_zigzag(start: int, length: int, cp_size: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Rank r's two chunks ``r`` and ``2P-1-r`` of ``length // 2P`` rows of a document at ``start`` (equal
    causal work on every rank), and the middle rows left over (fewer than ``2P``)."""
    c = length // (2 * cp_size)
    pairs = [(start + r * c, start + length - (r + 1) * c) for r in range(cp_size)]
    return [p for r in range(cp_size) for p in ((pairs[r][0], c), (pairs[r][1], c))], \
        (start + cp_size * c, length - 2 * cp_size * c)


@functools.lru_cache(maxsize=PACKINGS_KEPT)
def _packed_spans(layout: str, cp_size: int, starts: tuple[int, ...], lengths: tuple[int, ...]
                  ) -> tuple[tuple[Span, ...], ...]:
    """Every rank's spans for the documents at ``starts`` (``lengths`` valid rows each), all ranks at once, kept
    for the last ``PACKINGS_KEPT`` packings: a batch's scheme asks once per rank, and its data once per tensor.
    Only the offsets decide (not the mask inside documents): ``shard_sequence`` needs nothing else."""
    padded = [starts[d + 1] - starts[d] for d in range(len(starts) - 1)]
    if layout == "zigzag":
        multiple = document_multiple(layout, cp_size)
        bad = next((d for d, n in enumerate(padded) if n % multiple), None)
        if bad is not None:
            raise ValueError(f"layout='zigzag' cuts every document into 2*cp={multiple} chunks, but document {bad} "
                             f"has {padded[bad]} (padded) rows; pad every document to a multiple of {multiple} "
                             f"with cu_seqlens_padded (Megatron's THD packing does), or use layout='balanced' "
                             f"(no per-document padding)")
        ranks: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
        for start, n in zip(starts, padded):
            if n:
                chunks, _ = _split_zigzag(start, n, cp_size)
                for r in range(cp_size):
                    ranks[r] += chunks[2 * r:2 * r + 2]
    else:
        if starts[-1] % cp_size:
            raise ValueError(f"layout='balanced' gives every rank S/cp rows, but the packed sequence has {starts[-1]} "
                             f"rows, not divisible by cp={cp_size}; pad its tail to {starts[-1] + -starts[-1] % cp_size} "
                             f"rows (the last offset of cu_seqlens_padded)")
        ranks = _balanced_ranges(cp_size, starts, lengths)
    return tuple(tuple(_merge(pieces)) for pieces in ranks)


def _merge(pieces: list[tuple[int, int]]) -> list[Span]:
    """``(start, count)`` pieces as spans, neighbours fused (kept in the given order)."""
    spans: list[Span] = []
    for start, count in pieces:
        if count and spans and spans[-1].start + spans[-1].count == start:
            spans[-1] = Span(spans[-1].start, spans[-1].count + count)
        elif count:
            spans.append(Span(start, count))
    return spans


def _balanced_ranges(cp_size: int, starts: tuple[int, ...], lengths: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """``(start, count)`` pieces per rank: ``S/P`` rows each, causal work balanced, no padding added.

    A document whose work exceeds ``target / f`` (``target`` = total work / P) is cut zigzag-style into one
    equal-work pair of chunks per rank; its middle rest and every other document are *items*, placed
    heaviest first on the rank with the least work and room left (an item that overflows a rank is cut
    there, the rest placed again). ``f`` starts at 1 (only documents heavier than a rank's share are
    cut) and doubles until the balance is within 1 %: whole documents stay on one rank (no transfer
    for them) as long as they can, and cutting every document of at least ``2P`` rows is per-document
    zigzag without padding."""
    capacity = starts[-1] // cp_size
    prefix = work_prefix(starts, lengths)
    total = prefix(starts[-1])

    def cost(start: int, count: int) -> int:
        return prefix(start + count) - prefix(start)

    best = None
    factor = 1
    while True:
        ranks, loads = _place(cp_size, capacity, starts, cost, total / cp_size / factor)
        balance = max(loads) * cp_size / max(total, 1)
        if best is None or balance < best[0]:
            best = (balance, ranks)
        if balance <= 1.01 or total / cp_size / factor < 1:  # below 1 every document of 2P rows is cut
            return [sorted(pieces) for pieces in best[1]]
        factor *= 2


def _place(cp_size: int, capacity: int, starts: tuple[int, ...], cost, threshold: float
           ) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """One placement (see ``_balanced_ranges``): documents heavier than ``threshold`` are cut per rank."""
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
    loads, room = [0] * cp_size, [capacity] * cp_size
    items: list[tuple[int, int]] = []
    for d in range(len(starts) - 1):
        start, n = starts[d], starts[d + 1] - starts[d]
        if n >= 2 * cp_size and cost(start, n) > threshold:
            chunks, rest = _split_zigzag(start, n, cp_size)
            for r in range(cp_size):
                ranks[r] += chunks[2 * r:2 * r + 2]
                loads[r] += cost(*chunks[2 * r]) + cost(*chunks[2 * r + 1])
                room[r] -= 2 * chunks[2 * r][1]
            items.append(rest)
        elif n:
            items.append((start, n))
    queue = [(-cost(*it), it[0], it[1]) for it in items if it[1]]
    heapq.heapify(queue)  # heaviest first
    open_ranks = [(loads[r], r) for r in range(cp_size) if room[r] > 0]
    heapq.heapify(open_ranks)  # the least work first, then the lowest rank
    while queue:
        minus_work, start, n = heapq.heappop(queue)
        _, r = heapq.heappop(open_ranks)
        take = min(n, room[r])
        ranks[r].append((start, take))
        loads[r] += -minus_work if take == n else cost(start, take)
        room[r] -= take
        if room[r] > 0:
            heapq.heappush(open_ranks, (loads[r], r))
        if take < n:  # the rank is full: the rest goes back in line, by its own work
            heapq.heappush(queue, (-cost(start + take, n - take), start + take, n - take))
    return ranks, loads


def work_prefix(starts: Sequence[int], lengths: Sequence[int]) -> Callable[[int], int]:
    """``prefix(row)``: the causal work of the packed rows before ``row`` (row ``o`` of a document sees ``o + 1``
    keys; padding rows none), in O(log documents) a call with no per-row table (a 1M-row packing's table and its
    list took tens of milliseconds per batch)."""
    before = [0]
    for n in lengths:
        before.append(before[-1] + n * (n + 1) // 2)

    def prefix(row: int) -> int:
        d = bisect.bisect_right(starts, row) - 1
        if d >= len(lengths):  # the end of the sequence
            return before[-1]
        o = min(row - starts[d], lengths[d])
        return before[d] + o * (o + 1) // 2
    return prefix


def spans_positions(spans: Sequence[Span]) -> torch.Tensor:
    """Global positions of the local rows described by ``spans``, in local order."""
    return torch.cat([s.positions() for s in spans])


def _documents(seq_len: int, cu_seqlens, cu_seqlens_padded) -> Optional[Documents]:
    return None if cu_seqlens is None else documents_mask(cu_seqlens, cu_seqlens_padded, seq_len=seq_len)


def shard_index(seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag", cu_seqlens=None,
                cu_seqlens_padded=None) -> torch.Tensor:
    """Rows of the full (packed) sequence that rank ``cp_rank`` holds, in local order: ``[seq_len / cp_size]``."""
    documents = _documents(seq_len, cu_seqlens, cu_seqlens_padded)
    return spans_positions(layout_spans(layout, cp_size, cp_rank, seq_len, documents))


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag", cu_seqlens=None,
                    cu_seqlens_padded=None) -> torch.Tensor:
    """Position ids (for RoPE) of the tokens rank ``cp_rank`` holds: ``[seq_len / cp_size]`` int64.

    With ``cu_seqlens`` (a packed sequence) positions restart at 0 in every document."""
    index = shard_index(seq_len, cp_size, cp_rank, layout, cu_seqlens, cu_seqlens_padded)
    if cu_seqlens is None:
        return index
    starts = torch.tensor(_documents(seq_len, cu_seqlens, cu_seqlens_padded).starts[:-1], dtype=torch.int64)
    return index - starts[torch.searchsorted(starts, index, right=True) - 1]


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, layout: str = "zigzag", dim: int = 0,
                   cu_seqlens=None, cu_seqlens_padded=None) -> torch.Tensor:
    """The part of the full-sequence tensor ``x`` (sequence along ``dim``) that ``cp_rank`` holds
    (tokens, labels, loss masks alike; ``cu_seqlens``: a packed sequence's documents)."""
    index = shard_index(x.shape[dim], cp_size, cp_rank, layout, cu_seqlens, cu_seqlens_padded).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 0, cu_seqlens=None,
                     cu_seqlens_padded=None) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full tensor from every rank's shard, in cp-rank order."""
    cp_size = len(shards)
    local = shards[0].shape[dim]
    if any(s.shape[dim] != local for s in shards):
        raise ValueError(f"shards have different lengths along dim {dim}: {[s.shape[dim] for s in shards]}")
    seq_len = local * cp_size
    order = torch.cat([shard_index(seq_len, cp_size, r, layout, cu_seqlens, cu_seqlens_padded)
                       for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return torch.cat(list(shards), dim=dim).index_select(dim, inverse.to(shards[0].device))


def canonical_member_spans(member_spans: Sequence[Sequence[Span]]) -> tuple[list[Span], list[int]]:
    """Order the spans of several ranks (one ring member) by position and fuse neighbours.

    Returns the fused spans and the order in which the input spans (flattened) are concatenated.
    Used by the hierarchical algorithm: after the all-to-all, a level-0 group's tokens are one ring
    member's shard; ordering them by position makes a zigzag group a zigzag shard again.
    """
    flat = [s for spans in member_spans for s in spans]
    order = sorted(range(len(flat)), key=lambda i: flat[i].start)
    fused: list[Span] = []
    for i in order:
        s = flat[i]
        prev = fused[-1] if fused else None
        if prev is not None and prev.stride == s.stride == 1 and prev.last + 1 == s.start:
            fused[-1] = Span(prev.start, prev.count + s.count)
        else:
            fused.append(s)
    return fused, order
