"""Independent full-attention reference for tests: explicit fp64 softmax over the whole sequence.

Shares no code with the package's kernels (GQA by repeating KV heads, mask by comparison of
positions), so agreement means the sharded algorithms are exact, not that two copies agree.
"""
from __future__ import annotations

import torch


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   window: tuple[int, int] = (-1, -1)):
    """``q [S, b, h, d]``, ``k, v [S, b, h_kv, d]`` (fp64) -> ``out [S, b, h, d]``, ``lse [S, b, h]``.

    ``window=(left, right)``: query ``i`` also needs ``i - left <= j <= i + right`` (-1: unbounded)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    pos = torch.arange(q.shape[0])
    if causal:
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    left, right = window
    if left >= 0:
        scores = scores.masked_fill(pos[None, :] < pos[:, None] - left, float("-inf"))
    if right >= 0:
        scores = scores.masked_fill(pos[None, :] > pos[:, None] + right, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, dim=-1), v)
    return out, lse.permute(2, 0, 1)


def random_qkv(seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """Seeded fp64 ``q, k, v, dout`` for the full sequence (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(seq_len, batch, heads, head_dim), (seq_len, batch, kv_heads, head_dim),
              (seq_len, batch, kv_heads, head_dim), (seq_len, batch, heads, head_dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
