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

``diagonal = g > 1`` makes a block ``g`` equal sub-blocks along its diagonal, the band applying inside
each and nothing between them: how the schedule hands a fused op a whole narrow window as one call
(``g`` causal or anticausal squares, run as a batch) instead of one call per square.

``Documents`` (packed sequences, Megatron/TE ``thd``) is one more mask: the band of its ``within`` mask
applies inside each document and nothing crosses a document boundary, so ``span_blocks`` returns one
banded rectangle per document both spans touch; padding rows (between ``cu_seqlens`` and
``cu_seqlens_padded``) are in no rectangle: they see nothing and nothing sees them.

Nothing here imports the rest of the package (kernels import it).
"""
from __future__ import annotations

import functools
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol, Sequence, Union

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
    """Key row ``b`` of a block is visible to query row ``a`` iff ``lo <= b - a <= hi`` (None: unbounded).

    ``diagonal``: the block is that many equal sub-blocks along its diagonal (rows and keys cut into
    ``diagonal`` equal parts; part ``i`` of the rows sees only part ``i`` of the keys) and the band is
    in each sub-block's own rows. ``kind`` names the sub-blocks' mask."""

    lo: Optional[int] = None
    hi: Optional[int] = None
    diagonal: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.diagonal, int) or self.diagonal < 1:
            raise ValueError(f"BlockMask diagonal={self.diagonal!r} must be an int >= 1 (1: one block)")
        if self.diagonal > 1 and self.lo is None and self.hi is None:
            raise ValueError(f"BlockMask diagonal={self.diagonal} needs a band (lo or hi): full sub-blocks along a "
                             "diagonal are separate full blocks")

    def _sub(self, n: int, m: int) -> tuple[int, int]:
        """The rows and keys of one diagonal sub-block of an ``n x m`` block."""
        g = self.diagonal
        if n % g or m % g:
            raise ValueError(f"a {n}x{m} block cannot hold diagonal={g} equal sub-blocks; both sides must be "
                             f"multiples of {g}")
        return n // g, m // g

    @property
    def kind(self) -> str:
        if self.lo is None:
            return "full" if self.hi is None else "causal" if self.hi == 0 else "band"
        return "anticausal" if self.lo == 0 and self.hi is None else "band"

    def visible(self, n: int, m: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[n, m]`` bool: which (query row, key row) pairs of an ``n x m`` block are visible."""
        sn, sm = self._sub(n, m)
        rows, keys = torch.arange(n, device=device)[:, None], torch.arange(m, device=device)[None, :]
        diff = keys % sm - rows % sn
        keep = rows // sn == keys // sm
        if self.lo is not None:
            keep &= diff >= self.lo
        if self.hi is not None:
            keep &= diff <= self.hi
        return keep

    def pairs(self, n: int, m: int) -> int:
        """Visible pairs in an ``n x m`` block (closed form: the planner counts blocks of 100K rows)."""
        if self.diagonal > 1:
            return self.diagonal * BlockMask(self.lo, self.hi).pairs(*self._sub(n, m))
        # row a sees keys b < a + hi + 1 minus keys b < a + lo, each count clamped to [0, m]
        upper = n * m if self.hi is None else _clamped_sum(self.hi + 1, n + self.hi, m)
        lower = 0 if self.lo is None else _clamped_sum(self.lo, n - 1 + self.lo, m)
        return upper - lower

    def computed_pairs(self, n: int, m: int, tile: int) -> int:
        """Pairs a kernel with ``tile x tile`` tiles computes: per row tile, the whole tiles that hold
        a visible pair (the masked rest of those tiles is the waste); diagonal sub-blocks are tiled
        each on its own (they run as a batch)."""
        sn, sm = self._sub(n, m)
        return self.diagonal * sum(rows * (min(sm, k1 * tile) - k0 * tile)
                                   for rows, k0, k1 in self._row_tiles(sn, sm, tile))

    def tile_loads(self, n: int, m: int, tile: int) -> list[int]:
        """Key tiles each ``tile``-row tile of one diagonal sub-block of an ``n x m`` block touches (0 for a
        row tile that sees nothing): the work of each thread block of a fused kernel that gives every row
        tile one (the sub-blocks run as a batch of them)."""
        return [k1 - k0 for _, k0, k1 in self._row_tiles(*self._sub(n, m), tile)]

    def _row_tiles(self, n: int, m: int, tile: int) -> Iterator[tuple[int, int, int]]:
        """``(rows, first key tile, end key tile)`` of each ``tile``-row tile of a one-block ``n x m`` mask, in
        order (``0, 0`` for a tile that sees no key)."""
        for r in range(0, n, tile):
            r1 = min(r + tile, n)
            c0 = 0 if self.lo is None else max(0, r + self.lo)
            c1 = m if self.hi is None else min(m, r1 + self.hi)
            yield (r1 - r, c0 // tile, -(-c1 // tile)) if c1 > c0 else (r1 - r, 0, 0)

    @property
    def transposed(self) -> "BlockMask":
        """The same mask seen from the keys: key row ``b`` sees query row ``a`` iff ``-hi <= a - b <= -lo``."""
        return BlockMask(None if self.hi is None else -self.hi, None if self.lo is None else -self.lo, self.diagonal)


FULL_BLOCK, CAUSAL_BLOCK, ANTICAUSAL_BLOCK = BlockMask(), BlockMask(None, 0), BlockMask(0, None)


def block_mask(mask: BlockMask) -> BlockMask:
    """A kernel's mask argument, checked: a ``BlockMask`` (``CAUSAL_BLOCK``, ``FULL_BLOCK``, ...)."""
    if not isinstance(mask, BlockMask):
        raise TypeError(f"a kernel's mask must be a BlockMask (CAUSAL_BLOCK, FULL_BLOCK, ...), got {mask!r}")
    return mask


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

    def blocks(self, q_spans: Sequence[SpanLike], kv_spans: Sequence[SpanLike]) -> list[list[Rect]]:
        """Rectangles in local rows for a shard of ``q_spans`` against one of ``kv_spans``, in groups whose
        full pieces may be fused (here: one group)."""
        rects: list[Rect] = []
        qo = 0
        for qs in q_spans:
            ko = 0
            for ks in kv_spans:
                rects += [(qo + a0, qo + a1, ko + b0, ko + b1, m) for a0, a1, b0, b1, m in self.span_blocks(qs, ks)]
                ko += ks.count
            qo += qs.count
        return [rects]


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


FULL, CAUSAL = Full(), Causal()
Rect = tuple[int, int, int, int, BlockMask]


@dataclass(frozen=True)
class _SubSpan:
    start: int
    count: int
    stride: int


@dataclass(frozen=True)
class Documents:
    """Packed documents (Megatron/TE ``thd``): document ``d`` holds positions ``[p_d, p_d + n_d)`` with
    ``p = cu_seqlens_padded`` (``cu_seqlens`` when None) and ``n_d = cu_seqlens[d+1] - cu_seqlens[d]``;
    rows ``[p_d + n_d, p_{d+1})`` are padding. Query ``i`` sees key ``j`` iff both are valid rows of one
    document and ``within`` (``Causal()``, ``Full()`` or a ``SlidingWindow``) shows ``j`` to ``i``.

    Build it with ``documents_mask`` (which checks the offsets and names the fix)."""

    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: Optional[tuple[int, ...]] = None
    within: _BandMask = CAUSAL
    agreed_in: Optional[object] = field(default=None, compare=False, hash=False, repr=False)
    """The CP process group whose ranks have checked they all hold these offsets (``engine.agree_on_documents``)."""

    @property
    def starts(self) -> tuple[int, ...]:
        """Every document's first position (and the sequence length last)."""
        return self.cu_seqlens if self.cu_seqlens_padded is None else self.cu_seqlens_padded

    @property
    def seq_len(self) -> int:
        return self.starts[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Valid (unpadded) rows of each document."""
        cu = self.cu_seqlens
        return tuple(cu[d + 1] - cu[d] for d in range(len(cu) - 1))

    def intervals(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of each document's valid rows."""
        return [(p, p + n) for p, n in zip(self.starts, self.lengths)]

    def band(self) -> tuple[Optional[int], Optional[int]]:
        return self.within.band()

    def digest(self) -> int:
        """A fingerprint of the offsets, the same in every process (what CP ranks compare to agree)."""
        return packing_digest(self.cu_seqlens, self.cu_seqlens_padded)

    @property
    def hides_future(self) -> bool:
        return self.within.hides_future

    @functools.cached_property
    def _intervals_and_ends(self) -> tuple[list[tuple[int, int]], list[int]]:
        intervals = self.intervals()
        return intervals, [b for _, b in intervals]

    @functools.cached_property
    def _pieces_kept(self) -> dict[tuple, dict[int, list[tuple[int, _SubSpan]]]]:
        """``_pieces`` by spans: a ring's schedule asks for each member's spans at every step (2 P^2 asks, P spans)."""
        return {}

    def _pieces(self, spans: Sequence[SpanLike]) -> dict[int, list[tuple[int, _SubSpan]]]:
        """Per document, ``(local row offset, sub-span)`` of the rows of ``spans`` that are valid rows of it (kept
        per spans for this packing's life; the caller does not change them)."""
        key = tuple(spans)
        kept = self._pieces_kept.get(key)
        if kept is None:
            kept = self._pieces_kept[key] = self._derive_pieces(spans)
        return kept

    def _derive_pieces(self, spans: Sequence[SpanLike]) -> dict[int, list[tuple[int, _SubSpan]]]:
        intervals, ends = self._intervals_and_ends
        out: dict[int, list[tuple[int, _SubSpan]]] = {}
        offset = 0
        for s in spans:
            last = s.start + (s.count - 1) * s.stride
            d = bisect_right(ends, s.start)  # first document ending after the span's first position
            while d < len(intervals) and intervals[d][0] <= last:
                a, b = intervals[d]
                r0 = max(0, -((s.start - a) // s.stride))  # first row at or after a: ceil((a - start) / stride)
                r1 = min(s.count, -((s.start - b) // s.stride))
                if r1 > r0:
                    out.setdefault(d, []).append((offset + r0, _SubSpan(s.start + r0 * s.stride, r1 - r0, s.stride)))
                d += 1
            offset += s.count
        return out

    def span_blocks(self, qs: SpanLike, ks: SpanLike) -> list[Rect]:
        """One banded rectangle per document both spans hold valid rows of (span-local rows)."""
        return [r for group in self.blocks([qs], [ks]) for r in group]

    def blocks(self, q_spans: Sequence[SpanLike], kv_spans: Sequence[SpanLike]) -> list[list[Rect]]:
        """Rectangles in local rows, one group per document (documents never share a query or key row, so
        full pieces of different documents never fuse)."""
        kv = self._pieces(kv_spans)
        groups = []
        for d, q_pieces in self._pieces(q_spans).items():
            rects = [(qo + a0, qo + a1, ko + b0, ko + b1, m) for qo, qs in q_pieces for ko, ks in kv.get(d, ())
                     for a0, a1, b0, b1, m in self.within.span_blocks(qs, ks)]
            if rects:
                groups.append(rects)
        return groups


Mask = Union[Full, Causal, SlidingWindow, Documents]


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


def _offsets(name: str, x: object) -> tuple[int, ...]:
    """``x`` (a 1-D int32/int64 tensor, or a sequence of ints) as a tuple, or a ValueError naming the fix."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 (or int64) tensor [n_docs + 1] of document offsets, got "
                             f"dtype {x.dtype} shape {tuple(x.shape)}; build it with torch.tensor(offsets, "
                             f"dtype=torch.int32)")
        try:
            values = tuple(x.tolist())
        except (NotImplementedError, RuntimeError):  # meta, fake or another device that holds no readable values
            raise ValueError(f"{name} is on device {x.device}, whose values cannot be read; the offsets decide "
                             f"which rows attend, so pass them with their values: a CPU or CUDA tensor "
                             f"({name}.to('cpu') where they exist) or a list of ints") from None
    elif isinstance(x, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        values = tuple(x)
    else:
        raise ValueError(f"{name} must be a 1-D int32 tensor [n_docs + 1] of document offsets, got "
                         f"{type(x).__name__}")
    if len(values) < 2:
        raise ValueError(f"{name}={list(values)} needs at least two offsets [0, ..., seq_len] (one document)")
    if values[0] != 0:
        raise ValueError(f"{name}={_short(values)} must start at 0 (the first document's first row); prepend 0")
    bad = next((i for i in range(len(values) - 1) if values[i + 1] < values[i]), None)
    if bad is not None:
        raise ValueError(f"{name}={_short(values)} is not increasing: {name}[{bad + 1}]={values[bad + 1]} < "
                         f"{name}[{bad}]={values[bad]}; give cumulative document lengths (offsets that never "
                         f"decrease)")
    return values


def _short(values: tuple[int, ...]) -> str:
    return str(list(values)) if len(values) <= 12 else f"[{', '.join(map(str, values[:6]))}, ..., {values[-1]}]"


def packing_digest(cu_seqlens: Sequence[int], cu_seqlens_padded: Optional[Sequence[int]] = None) -> int:
    """A CRC of a packing's offsets, plus one (0 means "not packed"); not Python's per-process ``hash``."""
    values = [list(cu_seqlens), None if cu_seqlens_padded is None else list(cu_seqlens_padded)]
    if values[1] == values[0]:
        values[1] = None
    return zlib.crc32(repr(values).encode()) + 1


def documents_mask(cu_seqlens: object, cu_seqlens_padded: object = None, within: Optional[_BandMask] = None,
                   seq_len: Optional[int] = None) -> Documents:
    """The ``Documents`` mask for Megatron/TE ``cu_seqlens`` (and ``cu_seqlens_padded``), checked.

    ``within``: the mask inside each document (default causal). ``seq_len``: the packed sequence's
    length, which the last (padded) offset must equal."""
    cu = _offsets("cu_seqlens", cu_seqlens)
    padded = None if cu_seqlens_padded is None else _offsets("cu_seqlens_padded", cu_seqlens_padded)
    if padded is not None:
        if len(padded) != len(cu):
            raise ValueError(f"cu_seqlens_padded has {len(padded)} offsets but cu_seqlens has {len(cu)}; give one "
                             f"padded offset per document boundary")
        short = next((d for d in range(len(cu) - 1) if padded[d + 1] - padded[d] < cu[d + 1] - cu[d]), None)
        if short is not None:
            raise ValueError(f"document {short} has {cu[short + 1] - cu[short]} rows (cu_seqlens) but only "
                             f"{padded[short + 1] - padded[short]} padded rows (cu_seqlens_padded); a padded length "
                             f"must be at least the document's length")
    ends = padded if padded is not None else cu
    name = "cu_seqlens_padded" if padded is not None else "cu_seqlens"
    if seq_len is not None and ends[-1] != seq_len:
        raise ValueError(f"{name} ends at {ends[-1]} but the packed sequence has {seq_len} rows (s_local * cp); "
                         f"its last offset must be the sequence length: pad the last document to it with "
                         f"cu_seqlens_padded, or fix the offsets")
    mask = Documents(cu, padded if padded != cu else None, CAUSAL if within is None else as_mask(within))
    if isinstance(mask.within, Documents):
        raise ValueError("documents cannot nest: within must be Causal(), Full() or a SlidingWindow")
    return mask


def as_mask(mask: Mask) -> Mask:
    """A schedule's mask argument, checked: a mask value."""
    if not isinstance(mask, (_BandMask, Documents)):
        raise TypeError(f"mask={mask!r} must be Full(), Causal(), SlidingWindow(left, right) or Documents(...)")
    return mask