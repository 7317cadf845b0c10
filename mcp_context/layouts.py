"""Which global token positions each context-parallel rank holds, and moving tensors accordingly.

A rank's shard is a list of ``Span``s (arithmetic progressions of positions, each occupying
consecutive local rows):

- ``contiguous``: rank r holds ``[r*n, (r+1)*n)``, ``n = S/P``.
- ``zigzag``: the sequence is cut into ``2P`` chunks; rank r holds chunks ``r`` and ``2P-1-r``
  (the Megatron/TE convention: identical to megatron-core's ``get_batch_on_this_cp_rank``). Every
  rank then does the same causal work.
- ``striped``: rank r holds positions ``r, r+P, r+2P, ...`` (Striped Attention).

Position ids for RoPE must follow the tokens: ``shard_positions`` gives them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .cp_rules import check_seq_len

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


def layout_spans(layout: str, cp_size: int, cp_rank: int, seq_len: int) -> list[Span]:
    """The spans rank ``cp_rank`` holds, in local order."""
    check_seq_len(seq_len, cp_size, layout)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, {cp_size}) for cp_size={cp_size}")
    if layout == "contiguous":
        n = seq_len // cp_size
        return [Span(cp_rank * n, n)]
    if layout == "zigzag":
        c = seq_len // (2 * cp_size)
        return [Span(cp_rank * c, c), Span((2 * cp_size - 1 - cp_rank) * c, c)]
    return [Span(cp_rank, seq_len // cp_size, cp_size)]


def spans_positions(spans: Sequence[Span]) -> torch.Tensor:
    """Global positions of the local rows described by ``spans``, in local order."""
    return torch.cat([s.positions() for s in spans])


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Position ids (for RoPE) of the tokens rank ``cp_rank`` holds: ``[seq_len / cp_size]`` int64."""
    return spans_positions(layout_spans(layout, cp_size, cp_rank, seq_len))


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, layout: str = "zigzag", dim: int = 0
                   ) -> torch.Tensor:
    """The part of the full-sequence tensor ``x`` (sequence along ``dim``) that ``cp_rank`` holds."""
    index = shard_positions(x.shape[dim], cp_size, cp_rank, layout).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full tensor from every rank's shard, in cp-rank order."""
    cp_size = len(shards)
    local = shards[0].shape[dim]
    if any(s.shape[dim] != local for s in shards):
        raise ValueError(f"shards have different lengths along dim {dim}: {[s.shape[dim] for s in shards]}")
    seq_len = local * cp_size
    order = torch.cat([shard_positions(seq_len, cp_size, r, layout) for r in range(cp_size)])
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
