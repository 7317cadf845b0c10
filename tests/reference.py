"""Independent full-attention reference for tests: explicit fp64 softmax over the whole sequence.

Shares no code with the package's kernels (GQA by repeating KV heads, mask by comparison of
positions), so agreement means the sharded algorithms are exact, not that two copies agree.
"""
from __future__ import annotations

from typing import Optional

import torch


def document_ids(seq_len: int, cu_seqlens: list[int], cu_seqlens_padded: Optional[list[int]] = None) -> torch.Tensor:
    """``[seq_len]``: the document each row belongs to, -1 for padding rows (between the document's
    ``cu_seqlens`` length and its ``cu_seqlens_padded`` end)."""
    starts = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    ids = torch.full((seq_len,), -1)
    for d in range(len(cu_seqlens) - 1):
        ids[starts[d]:starts[d] + cu_seqlens[d + 1] - cu_seqlens[d]] = d
    return ids


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   window: tuple[int, int] = (-1, -1), documents: Optional[torch.Tensor] = None,
                   sink: Optional[torch.Tensor] = None):
    """``q [S, b, h, d]``, ``k [S, b, h_kv, d]``, ``v [S, b, h_kv, dv]`` (fp64) -> ``out [S, b, h, dv]``,
    ``lse [S, b, h]``.

    ``sink [h]``: one extra logit per head with no value in every row that sees a key (gpt-oss's
    attention sinks): the softmax runs over the row's scores and the sink, written out as a
    concatenated column.
    ``window=(left, right)``: query ``i`` also needs ``i - left <= j <= i + right`` (-1: unbounded).
    ``documents``: ``document_ids``; a query sees only keys of its own document, and a padding row
    (-1) sees nothing: its ``out`` is 0 and its ``lse`` ``-inf``, with zero gradients."""
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
    if documents is not None:
        same = (documents[None, :] == documents[:, None]) & (documents[:, None] >= 0)
        scores = scores.masked_fill(~same, float("-inf"))
    seen = torch.isfinite(scores).any(-1, keepdim=True)  # rows that see a key (finite math for the rest)
    scores = scores.masked_fill(~seen, 0.0)
    if sink is not None:
        scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~seen[..., 0], float("-inf"))
    probs = torch.softmax(scores, dim=-1)[..., :k.shape[0]]
    out = torch.einsum("bhqk,kbhd->qbhd", probs * seen, v)
    return out, lse.permute(2, 0, 1)


def random_qkv(seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int, seed: int,
               v_head_dim: Optional[int] = None):
    """Seeded fp64 ``q, k, v, dout`` for the full sequence (identical on every rank); ``v_head_dim``
    (default ``head_dim``): the value head dim, as in MLA."""
    gen = torch.Generator().manual_seed(seed)
    dv = head_dim if v_head_dim is None else v_head_dim
    shapes = [(seq_len, batch, heads, head_dim), (seq_len, batch, kv_heads, head_dim),
              (seq_len, batch, kv_heads, dv), (seq_len, batch, heads, dv)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
"""The engine tests' tolerances: max abs error of out, lse, dq, dk, dv (values and gradients are O(1))."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want| / max(1, |want|)``, in fp64 (absolute where ``|want| < 1``)."""
    got, want = got.double(), want.double()
    return ((got - want).abs() / want.abs().clamp(min=1)).max().item()


def in_both_dtypes(compare, rank: int, world: int, *args) -> dict:
    """``compare(rank, world, *args, dtype)`` in fp64 and in fp32 (wrap with ``functools.partial`` to get
    a distributed case)."""
    return {dtype: compare(rank, world, *args, dtype) for dtype in (torch.float64, torch.float32)}


def assert_within_tolerance(rank: int, dtype: torch.dtype, errors: dict) -> None:
    """Every ``{name: max abs error}`` of one rank within ``TOL[dtype]``."""
    for name, err in errors.items():
        assert err <= TOL[dtype], f"rank {rank} {dtype} {name}: max abs error {err:.3e} > {TOL[dtype]}"


def shard_errors(shard, out, lse, local, ref_out, ref_lse, ref_inputs, rows) -> dict:
    """Max abs errors of this rank's ``out``, ``lse`` (on ``rows``: padding rows excluded) and the q, k, v
    gradients of ``local`` against the full-sequence reference, cut to this rank by ``shard``."""
    pairs = {"out": (out, ref_out), "dq": (local[0].grad, ref_inputs[0].grad),
             "dk": (local[1].grad, ref_inputs[1].grad), "dv": (local[2].grad, ref_inputs[2].grad)}
    errors = {name: (a.double() - shard(b.detach())).abs().max().item() for name, (a, b) in pairs.items()}
    errors["lse"] = (lse[rows].double() - shard(ref_lse)[rows]).abs().max().item()
    return errors
