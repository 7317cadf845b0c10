"""Attention masks as values: the mask a caller asks for, and the block masks kernels compute.

A *mask* (``Full``, ``Causal``, ``SlidingWindow``) says which key positions each query position sees
over the whole sequence. The schedule asks it, for one query span against one key span, for
rectangles of local rows with a *block mask* each (``span_blocks``); it then cuts those into pieces
the chosen kernel computes natively. A block mask is one band in block-local rows: key row ``b`` is
visible to query row ``a`` iff ``lo <= b - a <= hi`` (``None``: unbounded). Its ``kind`` names what
kernels declare in ``Capabilities.masks``:

- ``full``: every key (``lo = hi = None``);
- ``causal``: ``b <= a`` on a square block (where top-left and bottom-right alignment agree);
- ``anticausal``: ``b >= a`` on a square block (the lower edge of a window);
- ``band``: anything else (a window narrower than the block: both edges cross it).

A document mask would be one more mask type whose ``span_blocks`` returns a rectangle per pair of
documents' rows; the schedule and the kernels already take any list of banded rectangles.

Nothing here imports the rest of the package (kernels import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch

BLOCK_MASK_KINDS = ("full", "causal", "anticausal", "band")


class SpanLike(Protocol):
    """What a mask reads of a ``layouts.Span``: positions ``start + row * stride`` for ``count`` rows."""

    start: int
    count: int
    stride: int


def _clamped_sum(x0: int, x1: int, m: int) -> int:
    """``sum(min(max(x, 0), m) for x in range(x0, x1 + 1))`` in closed form."""
    def upto(x: int) -> int:  # sum over 0..x of min(x', m)
        if x < 0:
            return 0
        return x * (x + 1) // 2 if x <= m else m * (m + 1) // 2 + (x - m) * m
    return upto(x1) - upto(x0 - 1) if x1 >= x0 else 0


@dataclass(frozen=True)
class BlockMask:
    """Key row ``b`` of a block is visible to query row ``a`` iff ``lo <= b - a <= hi`` (None: unbounded)."""

    lo: Optional[int] = None
    hi: Optional[int] = None

    @property
    def kind(self) -> str:
        if self.lo is None:
            return "full" if self.hi is None else "causal" if self.hi == 0 else "band"
        return "anticausal" if self.lo == 0 and self.hi is None else "band"

    def visible(self, n: int, m: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[n, m]`` bool: which (query row, key row) pairs of an ``n x m`` block are visible."""
        diff = torch.arange(m, device=device)[None, :] - torch.arange(n, device=device)[:, None]
        keep = torch.ones(n, m, dtype=torch.bool, device=device)
        if self.lo is not None:
            keep &= diff >= self.lo
        if self.hi is not None:
            keep &= diff <= self.hi
        return keep

    def pairs(self, n: int, m: int) -> int:
        """Visible pairs in an ``n x m`` block (closed form: the planner counts blocks of 100K rows)."""
        # row a sees keys b < a + hi + 1 minus keys b < a + lo, each count clamped to [0, m]
        upper = n * m if self.hi is None else _clamped_sum(self.hi + 1, n + self.hi, m)
        lower = 0 if self.lo is None else _clamped_sum(self.lo, n - 1 + self.lo, m)
        return upper - lower

    def computed_pairs(self, n: int, m: int, tile: int) -> int:
        """Pairs a kernel with ``tile x tile`` tiles computes: per row tile, the whole tiles that hold
        a visible pair (the masked rest of those tiles is the waste)."""
        total = 0
        for r in range(0, n, tile):
            r1 = min(r + tile, n)
            c0 = 0 if self.lo is None else max(0, r + self.lo)
            c1 = m if self.hi is None else min(m, r1 + self.hi)
            if c1 > c0:
                total += (r1 - r) * (min(m, -(-c1 // tile) * tile) - c0 // tile * tile)
        return total


FULL_BLOCK, CAUSAL_BLOCK, ANTICAUSAL_BLOCK = BlockMask(), BlockMask(None, 0), BlockMask(0, None)


def block_mask(mask: Union[bool, BlockMask]) -> BlockMask:
    """A kernel's mask argument as a ``BlockMask`` (``True``/``False`` still mean causal/full)."""
    if isinstance(mask, BlockMask):
        return mask
    return CAUSAL_BLOCK if mask else FULL_BLOCK


class _BandMask:
    """A mask that is one band of positions: query ``i`` sees keys ``j`` with ``lo <= j - i <= hi``."""

    def band(self) -> tuple[Optional[int], Optional[int]]:
        raise NotImplementedError

    @property
    def window_size(self) -> tuple[int, int]:
        """The Megatron/TE ``(left, right)`` form, ``-1`` for unbounded."""
        lo, hi = self.band()
        return (-1 if lo is None else -lo, -1 if hi is None else hi)

    @property
    def hides_future(self) -> bool:
        """True when no query sees a later key (causal, or a window with ``right == 0``)."""
        return self.band()[1] == 0

    def span_blocks(self, qs: SpanLike, ks: SpanLike) -> list[tuple[int, int, int, int, BlockMask]]:
        """``(q0, q1, k0, k1, block_mask)`` rectangles of span-local rows for query span ``qs`` against
        key span ``ks``; pairs outside them are masked. Positions ``start + row * stride``."""
        lo, hi = self.band()
        n, m = qs.count, ks.count
        if lo is None and hi is None:
            return [(0, n, 0, m, FULL_BLOCK)]
        if qs.stride != ks.stride:
            raise ValueError(f"cannot derive a {type(self).__name__} mask between spans of strides {qs.stride} and "
                             f"{ks.stride}")
        d, s = ks.start - qs.start, qs.stride  # j - i = d + (b - a) * s
        blo = None if lo is None else -((d - lo) // s)  # ceil((lo - d) / s)
        bhi = None if hi is None else (hi - d) // s
        if ((blo is not None and blo > m - 1) or (bhi is not None and bhi < -(n - 1))
                or (blo is not None and bhi is not None and blo > bhi)):
            return []
        return [(0, n, 0, m, BlockMask(None if blo is None or blo <= -(n - 1) else blo,
                                       None if bhi is None or bhi >= m - 1 else bhi))]


@dataclass(frozen=True)
class Full(_BandMask):
    """Every query sees every key."""

    def band(self) -> tuple[Optional[int], Optional[int]]:
        return None, None


@dataclass(frozen=True)
class Causal(_BandMask):
    """Query ``i`` sees keys ``j <= i``."""

    def band(self) -> tuple[Optional[int], Optional[int]]:
        return None, 0


@dataclass(frozen=True)
class SlidingWindow(_BandMask):
    """Megatron/TE ``window_size``: query ``i`` sees keys ``j`` with ``i - left <= j <= i + right``;
    ``-1`` leaves that side unbounded."""

    left: int = -1
    right: int = -1

    def __post_init__(self) -> None:
        _check_window(self.left, self.right)

    def band(self) -> tuple[Optional[int], Optional[int]]:
        return (None if self.left == -1 else -self.left), (None if self.right == -1 else self.right)


Mask = Union[Full, Causal, SlidingWindow]
FULL, CAUSAL = Full(), Causal()


def _check_window(left: object, right: object) -> None:
    for name, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"window_size=({left!r}, {right!r}): {name} must be an int (>= 0, or -1 for "
                             f"unbounded), not {type(x).__name__}")
        if x < -1:
            raise ValueError(f"window_size=({left}, {right}): {name}={x} is negative; use a number of positions "
                             f">= 0, or -1 for an unbounded {name} side")


def attention_mask(causal: bool, window_size: Optional[tuple[int, int]] = None) -> Mask:
    """The mask for the public ``causal`` and ``window_size=(left, right)`` arguments.

    ``None`` or ``(-1, -1)`` is plain full or causal attention; ``causal=True`` caps ``right`` at 0."""
    if window_size is None:
        return CAUSAL if causal else FULL
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size={window_size!r} must be None or a pair (left, right) of ints, -1 for an "
                         f"unbounded side, e.g. (4096, 0)")
    left, right = window_size
    _check_window(left, right)
    if causal:
        right = 0
    if left == -1 and right in (-1, 0):
        return CAUSAL if right == 0 else FULL
    return SlidingWindow(left, right)


def as_mask(mask: Union[bool, Mask]) -> Mask:
    """A schedule's mask argument as a mask value (``True``/``False`` still mean causal/full)."""
    if isinstance(mask, bool):
        return CAUSAL if mask else FULL
    if not isinstance(mask, _BandMask):
        raise TypeError(f"mask={mask!r} must be Full(), Causal(), SlidingWindow(left, right) or a bool")
    return mask
