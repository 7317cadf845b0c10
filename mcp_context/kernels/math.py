"""The pure-torch block-attention kernel: the reference path, any device, any float dtype.

Computes in fp32 (fp64 for fp64 input) with an explicit softmax over one block. GQA groups the
query heads over each KV head with a reshape (no repeated KV). The backward recomputes the
probabilities from the final ``lse`` instead of saving them: memory stays O(block), not O(s^2).
Applies every block mask itself, bands included (``masks.BlockMask.visible``). V may have its own
head dim (MLA's ``dv != dqk``): scores use q's and k's columns, ``out`` and dV have v's.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import BLOCK_MASK_KINDS, BlockMask, block_mask
from .base import FLOAT_DTYPES, Capabilities, Dropout, accum_dtype, finite_lse_for_backward


def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``[b, h, s, d] -> [b, h_kv, h/h_kv, s, d]`` (query heads grouped by the KV head they use)."""
    b, h, s, d = q.shape
    return q.reshape(b, h_kv, h // h_kv, s, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Scaled scores ``[b, h_kv, g, sq, sk]`` with masked pairs at ``-inf``."""
    s = torch.einsum("bngqd,bnkd->bngqk", _grouped(q, k.shape[1]).to(dtype), k.to(dtype)) * scale
    if mask.kind != "full":
        s = s.masked_fill(~mask.visible(*s.shape[-2:], device=s.device), float("-inf"))
    return s


class MathKernel:
    name = "math"
    capabilities = Capabilities(devices=frozenset({"cpu", "cuda", "meta"}), dtypes=frozenset(FLOAT_DTYPES),
                                native_gqa=True, masks=frozenset(BLOCK_MASK_KINDS), dropout=True,
                                distinct_v_dim=True)

    def forward(self, q, k, v, mask, scale, dropout: Optional[Dropout] = None):
        dtype = accum_dtype(q.dtype)
        s = _scores(q, k, block_mask(mask), scale, dtype)
        lse = torch.logsumexp(s, dim=-1)  # -inf on fully masked rows
        p = torch.exp(s - finite_lse_for_backward(lse).unsqueeze(-1))
        if dropout is not None:
            p = p * dropout.keep_scaled(p.shape, p.device, dtype)
        out = torch.einsum("bngqk,bnkd->bngqd", p, v.to(dtype))
        b, n, g, sq, d = out.shape
        return out.reshape(b, n * g, sq, d), lse.reshape(b, n * g, sq)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout: Optional[Dropout] = None):
        dtype = accum_dtype(q.dtype)
        h_kv = k.shape[1]
        s = _scores(q, k, block_mask(mask), scale, dtype)
        lse_g = _grouped(lse.unsqueeze(-1), h_kv).to(dtype)
        p = torch.exp(s - lse_g)
        do = _grouped(dout, h_kv).to(dtype)
        delta = (do * _grouped(out, h_kv).to(dtype)).sum(-1, keepdim=True)
        dp = torch.einsum("bngqd,bnkd->bngqk", do, v.to(dtype))
        if dropout is None:
            dv = torch.einsum("bngqk,bngqd->bnkd", p, do)
        else:  # out used the kept, rescaled probabilities; delta = rowsum(dout * out) still holds
            keep = dropout.keep_scaled(p.shape, p.device, dtype)
            dv = torch.einsum("bngqk,bngqd->bnkd", p * keep, do)
            dp = dp * keep
        ds = p * (dp - delta)
        dq = torch.einsum("bngqk,bnkd->bngqd", ds, k.to(dtype)) * scale
        dk = torch.einsum("bngqk,bngqd->bnkd", ds, _grouped(q, h_kv).to(dtype)) * scale
        return dq.reshape(q.shape), dk, dv
