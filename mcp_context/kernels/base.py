"""What every block-attention backend is and declares: the ``Kernel`` protocol and ``Capabilities``.

A kernel computes one block on one device, ``(q, k, v, mask) -> (out, lse)`` on ``[b, h, s, d]``
tensors (``h`` query heads, ``h_kv`` key/value heads with ``h % h_kv == 0``; ``v`` and ``out`` may have
a head dim ``dv`` other than q's and k's where ``Capabilities.distinct_v_dim`` says so), and the block's
gradients from the *final* merged ``(out, lse)`` of the whole attention, as flash-attention does, so
nothing O(s^2) is kept. ``mask`` is a ``masks.BlockMask`` (``True``/``False`` mean causal/full); the
schedule only sends a kernel the kinds its ``Capabilities.masks`` declare: every kernel computes
``full`` and ``causal`` on a square block (query ``i`` sees keys ``0..i``, where top-left and
bottom-right alignment agree); ``anticausal`` squares and ``band`` blocks only where declared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..masks import BlockMask

BLOCK_MASKS = ("full", "causal")
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports; the registry filters on it before probing.

    ``native_gqa``: takes fewer key/value heads than query heads without repeating them (its dK/dV
    come back with ``h_kv`` heads). ``masks``: the block masks it computes itself. ``dropout``: it
    can replay a seeded dropout mask per block (the fused ops draw their own masks, so they cannot).
    ``distinct_v_dim``: takes a value head dim other than the query/key head dim (MLA: DeepSeek-V3's
    ``dqk = 192``, ``dv = 128``); ``out`` and dV then have ``dv`` columns.
    """

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    native_gqa: bool
    masks: frozenset[str] = frozenset(BLOCK_MASKS)
    dropout: bool = False
    distinct_v_dim: bool = False

    def refusal(self, device: torch.device, dtype: torch.dtype, dropout: bool,
                distinct_v_dim: bool = False) -> Optional[str]:
        """Why this backend cannot serve ``(device, dtype, dropout, dv != dqk)``, or None if it may."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(sorted(self.devices))} only, not {device.type}"
        if dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES if d in self.dtypes)
            return f"supports {names} only, not {str(dtype).replace('torch.', '')}"
        if dropout and not self.dropout:
            return "cannot replay a per-block dropout mask (use dropout 0 or the math kernel)"
        if distinct_v_dim and not self.distinct_v_dim:
            return "needs the value head dim equal to the query/key head dim (MLA's dv != dqk goes to another kernel)"
        return None


@dataclass(frozen=True)
class Dropout:
    """Attention dropout for one block: probability ``p``; the keep-mask is drawn from ``seed``, so the
    backward (and activation recomputation) regenerates exactly the forward's mask."""

    p: float
    seed: int

    def keep_scaled(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``mask / (1 - p)`` with ``mask ~ Bernoulli(1 - p)`` of ``shape``."""
        gen = torch.Generator(device=device).manual_seed(self.seed)
        keep = torch.rand(shape, generator=gen, device=device) >= self.p
        return keep.to(dtype) / (1.0 - self.p)


class Kernel(Protocol):
    """What the ring executor needs from a block-attention backend."""

    name: str
    capabilities: Capabilities

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float,
                dropout: Optional[Dropout] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``out [b, h, sq, dv]`` and ``lse [b, h, sq]`` (fp32, or fp64 for fp64 input).

        With dropout, ``out`` uses the dropped probabilities and ``lse`` the undropped scores, so
        blocks merge exactly as without dropout."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, mask: BlockMask, scale: float,
                 dropout: Optional[Dropout] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``dq, dk, dv`` for this block given the final merged ``out`` (q's dtype) and
        ``lse`` (the accumulator dtype, ``-inf`` already replaced by ``finite_lse_for_backward``)."""


def fold_rows(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, h, g*s, ...] -> [g*b, h, s, ...]``: ``g`` equal row ranges as batch entries, the form a fused op
    takes several blocks in one call in (a diagonal run's squares, ``torch_sdpa``; a step's stacked tasks,
    ``algorithms/calls.py``). A view of ``x`` when ``b == 1`` (an sbhd or bshd shard folds into bshd-packed batch
    entries); copied otherwise, bshd-packed too, so a call's folded operands share one layout."""
    t = x.transpose(1, 2)  # [b, g*s, h, ...]: the rows outside the heads, as the executor's storage has them
    return t.unflatten(1, (g, x.shape[2] // g)).movedim(1, 0).flatten(0, 1).transpose(1, 2)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Turn ``-inf`` (fully masked rows) into ``+inf`` so ``exp(score - lse)`` is 0, never NaN (one
    elementwise kernel; a NaN stays NaN)."""
    return lse.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=float("inf"))
