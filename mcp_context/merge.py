"""Online-softmax merging of partial attention results ``(out, lse)`` over disjoint key sets.

Everything is done in the accumulator dtype (fp32, or fp64 for fp64 inputs) in the stable form
``lse = max + log1p(exp(min - max))``; each ``out`` is rescaled by ``exp(lse_i - lse)``. A row that
has seen no visible key yet has ``lse = -inf`` and ``out = 0``; merging two such rows keeps them so,
with no NaN, which is what a fully masked causal chunk needs.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x == NEG_INF, 0.0)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold ``(block_out, block_lse)`` into the accumulators ``out [..., s, d]``, ``lse [..., s]`` in place.

    ``out``/``lse`` may be views (a query sub-range of the full accumulator).
    """
    block_lse = block_lse.to(lse.dtype)
    hi = torch.maximum(lse, block_lse)
    lo = torch.minimum(lse, block_lse)
    new_lse = hi + torch.log1p(torch.exp(lo - _finite(hi)))
    ref = _finite(new_lse)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - ref).unsqueeze(-1))
    lse.copy_(new_lse)
