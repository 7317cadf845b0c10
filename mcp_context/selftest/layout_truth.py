"""Which rows each CP rank must hold, from a definition that is not the code under test.

``boundaries.unslice`` puts our slices back with our own unslicing, so a layout that is wrong the same
way in both (two ranks' chunks swapped in ``layouts.layout_spans``) passes it, while megatron-core's
RoPE (``get_pos_emb_on_this_cp_rank``) keeps the real zigzag and training drifts from CP = 1. This
module holds the slicing to:

- megatron-core's own ``get_batch_on_this_cp_rank`` and ``get_pos_emb_on_this_cp_rank`` (unpacked),
  and its thd RoPE slice ``_get_thd_freqs_on_this_cp_rank`` per document (packed);
- each layout's positions written out here from its definition: ``zigzag`` chunks ``r`` and
  ``2P-1-r`` of ``2P`` (per padded document when packed), ``contiguous`` ``[r*S/P, (r+1)*S/P)``,
  ``striped`` ``r, r+P, ...`` (these two over the whole packed sequence, as the engine places them). ``balanced`` is a placement search with no closed form: it is held to
  what it promises (every rank ``S/P`` rows, together every row once, each piece in position order).

Owns no collective: everything here runs on one process for every rank (model-independent, cheap, so
it runs for every model and under ``--simulate``).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def expected_rows(layout: str, cp_size: int, cp_rank: int, seq_len: int,
                  padded: Optional[Sequence[int]] = None) -> Optional[list[int]]:
    """The rows of the full sequence rank ``cp_rank`` holds, in local order, by the layout's definition
    (``padded``: a packed sequence's ``cu_seqlens_padded``, which only the zigzag follows: per document);
    None for ``balanced`` (no closed form)."""
    def zigzag(start: int, length: int) -> list[int]:
        c = length // (2 * cp_size)
        first, second = start + cp_rank * c, start + (2 * cp_size - 1 - cp_rank) * c
        return list(range(first, first + c)) + list(range(second, second + c))

    if layout == "balanced":
        return None
    if padded is not None and layout == "zigzag":  # contiguous and striped ignore the documents
        return [row for a, b in zip(padded, padded[1:]) for row in zigzag(a, b - a)]
    if layout == "zigzag":
        return zigzag(0, seq_len)
    if layout == "contiguous":
        n = seq_len // cp_size
        return list(range(cp_rank * n, (cp_rank + 1) * n))
    if layout == "striped":
        return list(range(cp_rank, seq_len, cp_size))
    raise ValueError(f"layout={layout!r} has no definition here; choose zigzag, contiguous or striped")


def expected_positions(rows: Sequence[int], padded: Optional[Sequence[int]] = None) -> list[int]:
    """RoPE position of each row: the row itself, or (packed) its offset in its padded document."""
    if padded is None:
        return list(rows)
    starts = torch.tensor(list(padded[:-1]))
    index = torch.tensor(list(rows), dtype=torch.long)
    return (index - starts[torch.searchsorted(starts, index, right=True) - 1]).tolist()


def balanced_problems(every_rank_rows: list[list[int]], seq_len: int) -> list[str]:
    """What breaks the balanced layout's promises: ``S/P`` rows per rank, every row held once."""
    cp_size = len(every_rank_rows)
    problems = [f"rank {r} holds {len(rows)} rows, not S/P = {seq_len // cp_size}"
                for r, rows in enumerate(every_rank_rows) if len(rows) != seq_len // cp_size]
    held = sorted(row for rows in every_rank_rows for row in rows)
    if held != list(range(seq_len)):
        problems.append("the ranks' rows are not every row 0..S-1 exactly once")
    return problems


class CPRank:
    """What megatron-core reads of a CP group (``size()``, ``rank()``), for any rank of any size."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@contextlib.contextmanager
def _initialised():
    """megatron-core's ``get_pg_size`` reads a group only once torch.distributed is initialised: a fake
    one-rank world where it is not (``--simulate``)."""
    if dist.is_initialized():
        yield
        return
    from ..plan.dryrun import fake_world

    with fake_world(1, 0):
        yield


def megatron_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """megatron-core's ``get_batch_on_this_cp_rank`` of ``batch`` (unpacked ``[b, S]`` tensors) for
    ``cp_rank`` (on a copy: it writes into the dict)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    with _initialised():
        return get_batch_on_this_cp_rank(dict(batch), CPRank(cp_size, cp_rank))


def megatron_rope_positions(seq_len: int, cp_size: int, cp_rank: int, device: torch.device,
                            padded: Optional[Sequence[int]] = None) -> list[int]:
    """The positions megatron-core's RoPE gives rank ``cp_rank``: ``get_pos_emb_on_this_cp_rank`` of a
    table holding each position's own index, or (packed) ``_get_thd_freqs_on_this_cp_rank`` per document."""
    from megatron.core.models.common.embeddings import rope_utils

    import megatron_patches

    megatron_patches.apply_all(device=device)  # on the CPU: megatron-core's slice without pinned memory
    if padded is None:
        table = torch.arange(seq_len, dtype=torch.float32, device=device).view(seq_len, 1, 1, 1)
        return rope_utils.get_pos_emb_on_this_cp_rank(table, 0, CPRank(cp_size, cp_rank)).flatten().long().tolist()
    positions: list[int] = []
    for a, b in zip(padded, padded[1:]):
        local = torch.empty((b - a) // cp_size)
        freqs = torch.arange(b - a)
        positions += rope_utils._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, local, freqs).tolist()
    return positions
