"""The self-test's own reference: explicit fp64 softmax attention over the gathered full sequence.

Shares no code with the engine's kernels, merge or schedule (GQA by repeating KV heads, masks by
comparing positions, sinks as one more softmax column), so agreement means the sharded computation is
exact. Query rows are taken in chunks, each chunk's forward and backward run before the next, so the
peak is a chunk's scores ``[b, h, chunk, S]`` rather than ``[b, h, S, S]``; gradients of K, V and the
sinks accumulate over chunks.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

REFERENCE_CHUNK = 1024


def document_ids(seq_len: int, cu_seqlens: Sequence[int], cu_seqlens_padded: Sequence[int]) -> torch.Tensor:
    """``[seq_len]``: each row's document, -1 for padding rows (after a document's real length)."""
    ids = torch.full((seq_len,), -1)
    for d in range(len(cu_seqlens) - 1):
        start = cu_seqlens_padded[d]
        ids[start:start + cu_seqlens[d + 1] - cu_seqlens[d]] = d
    return ids


def _scores_mask(rows: torch.Tensor, cols: torch.Tensor, window: Optional[tuple[int, int]],
                 documents: Optional[torch.Tensor]) -> torch.Tensor:
    """``[chunk, S]`` True where query ``rows[i]`` may see key ``cols[j]`` (causal, window, document)."""
    i, j = rows[:, None], cols[None, :]
    seen = j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
    if documents is not None:
        seen &= (documents[rows][:, None] == documents[None, :]) & (documents[rows][:, None] >= 0)
    return seen


def _chunk_attention(q, k, v, sink, rows, scale, window, documents):
    """``q [c, b, h, d]`` rows ``rows`` against all of ``k [S, b, h, d]``, ``v [S, b, h, dv]`` (heads
    already repeated) -> ``out [c, b, h, dv]``, ``lse [c, b, h]``."""
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    seen = _scores_mask(rows, torch.arange(k.shape[0], device=rows.device), window, documents)
    scores = scores.masked_fill(~seen, float("-inf"))
    any_seen = seen.any(-1)                                   # [c]: padding rows see nothing
    scores = scores.masked_fill(~any_seen[:, None], 0.0)
    if sink is not None:
        scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~any_seen, float("-inf"))
    probs = torch.softmax(scores, dim=-1)[..., :k.shape[0]] * any_seen[:, None].to(scores.dtype)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out, lse.permute(2, 0, 1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, scale: float,
                        window: Optional[tuple[int, int]] = None, documents: Optional[torch.Tensor] = None,
                        sink: Optional[torch.Tensor] = None, chunk: int = REFERENCE_CHUNK) -> dict:
    """Causal attention over the full sequence in fp64 and its backward for ``dout``.

    ``q [S, b, h, d]``, ``k [S, b, h_kv, d]``, ``v [S, b, h_kv, dv]``, ``dout [S, b, h, dv]``;
    ``documents``: ``document_ids`` (a query sees only its document's keys; padding rows see nothing:
    out 0, lse -inf); ``sink [h]``: one more logit per head with no value. Returns ``out, lse, dq, dk,
    dv`` (and ``dsink``) as fp64 tensors."""
    q, k, v, dout = (x.detach().double() for x in (q, k, v, dout))
    k_leaf, v_leaf = k.clone().requires_grad_(), v.clone().requires_grad_()
    sink_leaf = None if sink is None else sink.detach().double().clone().requires_grad_()
    rep = q.shape[2] // k.shape[2]
    outs, lses, dqs = [], [], []
    if documents is not None:
        documents = documents.to(q.device)
    for start in range(0, q.shape[0], chunk):
        k_rep, v_rep = k_leaf.repeat_interleave(rep, dim=2), v_leaf.repeat_interleave(rep, dim=2)
        q_chunk = q[start:start + chunk].clone().requires_grad_()
        rows = torch.arange(start, start + q_chunk.shape[0], device=q.device)
        out, lse = _chunk_attention(q_chunk, k_rep, v_rep, sink_leaf, rows, scale, window, documents)
        out.backward(dout[start:start + chunk])
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(q_chunk.grad)
    result = {"out": torch.cat(outs), "lse": torch.cat(lses), "dq": torch.cat(dqs), "dk": k_leaf.grad,
              "dv": v_leaf.grad}
    if sink_leaf is not None:
        result["dsink"] = sink_leaf.grad
    return result


def random_inputs(seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int, v_head_dim: int,
                  seed: int, softmax_type: str = "vanilla") -> dict:
    """Seeded fp64 ``q, k, v, dout`` over the full sequence (identical on every rank) and the sinks:
    random for 'learnable', zeros for 'off-by-one', None for 'vanilla'."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (seq_len, batch, heads, head_dim), "k": (seq_len, batch, kv_heads, head_dim),
              "v": (seq_len, batch, kv_heads, v_head_dim), "dout": (seq_len, batch, heads, v_head_dim)}
    data = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    sink = torch.randn(heads, generator=gen, dtype=torch.float64)
    data["sink"] = {"vanilla": None, "off-by-one": torch.zeros(heads, dtype=torch.float64),
                    "learnable": sink}[softmax_type]
    return data
