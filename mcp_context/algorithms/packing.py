"""K and V as one packed tensor: ``[n, b, h_kv, dqk + dv]`` token-major, each head's K in its first ``dqk``
columns and its V after (each keeping its own head dim: MLA's ``dv != dqk``).

K/V move this way wherever they move (a ring message, the all-to-all, the all-gather and its reorder), so
one collective and one copy serve both where two did, and their gradients come back the same way: the
gradient walks already sum dK/dV in one buffer of this layout. ``packed_columns`` recognises a K and V that
already are the two column ranges of one packed buffer, so nothing packs them twice or splits a packed
gradient only to concatenate it again.
"""
from __future__ import annotations

from typing import Optional

import torch


def packed_columns(k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
    """The contiguous ``[..., dqk + dv]`` tensor whose column ranges ``k [..., dqk]`` and ``v [..., dv]`` are (a
    view, no copy), or None when they are not exactly that (separate tensors, another layout)."""
    if (k._base is None or k._base is not v._base or k.dtype != v.dtype or k.shape[:-1] != v.shape[:-1]
            or k.stride() != v.stride() or k.stride(-1) != 1
            or v.storage_offset() != k.storage_offset() + k.shape[-1]):
        return None
    packed = k.as_strided(tuple(k.shape[:-1]) + (k.shape[-1] + v.shape[-1],), k.stride(), k.storage_offset())
    return packed if packed.is_contiguous() else None


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k [b, h_kv, n, dqk]``, ``v [b, h_kv, n, dv]`` (views of token-major storage) -> one contiguous
    ``[n, b, h_kv, dqk + dv]`` message (view it with ``rotation.bhsd``): the buffer they are columns of when
    they already are (``packed_columns``), else one concatenation."""
    kt, vt = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
    packed = packed_columns(kt, vt)
    return torch.cat([kt, vt], dim=-1) if packed is None else packed


def split_kv(kv: torch.Tensor, dqk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of K and V in a packed tensor (any layout whose last dim holds ``dqk`` key columns, then the
    value's): a message, a dK/dV accumulator, a gathered K/V."""
    return kv.narrow(-1, 0, dqk), kv.narrow(-1, dqk, kv.shape[-1] - dqk)  # narrow: see executor._copy_


def column_view(storage: torch.Tensor, shape: tuple[int, ...], at: int, first: int, width: int) -> torch.Tensor:
    """Columns ``[first, first + width)`` of a packed token-major ``[n, b, h_kv, dims]`` laid out contiguously in
    ``storage``'s storage from element ``at``, as the kernels and adds index them: ``[b, h_kv, n, width]``, one
    view op."""
    n, b, h, dims = shape
    return storage.as_strided((b, h, n, width), (h * dims, dims, b * h * dims, 1), at + first)


def kv_blocks(kv: torch.Tensor, dqk: int, shape: Optional[tuple[int, ...]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[b, h_kv, n, dqk]`` and V ``[b, h_kv, n, dv]`` as the kernels read them, from a packed ``[n, b, h_kv,
    dqk + dv]`` laid out contiguously in ``kv``'s storage from its offset (``kv`` itself, or a flat buffer holding
    one of ``shape``): what ``split_kv(rotation.bhsd(kv), dqk)`` gives, in two view ops where that takes three (a
    ring issues them every step)."""
    if shape is None and not kv.is_contiguous():  # a view of it would read the wrong elements
        raise ValueError(f"a packed K/V message must be contiguous [n, b, h_kv, dqk + dv]; got sizes {tuple(kv.shape)} "
                         f"strides {kv.stride()}")
    shape, at = tuple(kv.shape) if shape is None else shape, kv.storage_offset()
    return column_view(kv, shape, at, 0, dqk), column_view(kv, shape, at, dqk, shape[-1] - dqk)


class _Pack(torch.autograd.Function):
    """``k [s, b, h_kv, dqk]``, ``v [s, b, h_kv, dv]`` -> packed ``[s, b, h_kv, dqk + dv]`` (one copy);
    backward: the packed gradient's column views."""

    @staticmethod
    def forward(ctx, k, v):
        ctx.dqk = k.shape[-1]
        return torch.cat([k, v], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return split_kv(grad, ctx.dqk)


class _Split(torch.autograd.Function):
    """Packed ``[s, b, h_kv, dqk + dv]`` -> its K and V column views (no copy); backward: the buffer dK and dV
    are columns of (the executor's, as it is), else one concatenation."""

    @staticmethod
    def forward(ctx, kv, dqk):
        return split_kv(kv, dqk)

    @staticmethod
    def backward(ctx, dk, dv):
        packed = packed_columns(dk, dv)
        return (torch.cat([dk, dv], dim=-1) if packed is None else packed), None


def packed(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V ``[s, b, h_kv, d]`` as one packed tensor, differentiable (for a move of both at once)."""
    return _Pack.apply(k, v)


def unpacked(kv: torch.Tensor, dqk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views of a packed ``kv`` whose keys have ``dqk`` columns, differentiable."""
    return _Split.apply(kv, dqk)
