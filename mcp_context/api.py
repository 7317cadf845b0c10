"""The functional API: ``context_parallel_attention`` — validate, pick a kernel, run a scheme."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch.distributed import ProcessGroup

from .algorithms import COMM_ALIASES, COMM_TYPES, a2a_degree, context_parallel_forward
from .comm import HCPGroups
from .kernels import get_kernel
from .layouts import check_layout, check_seq_len


def normalize_comm(comm: str) -> str:
    """Canonical ``cp_comm_type`` name (``allgather`` -> ``all_gather``); ValueError for unknown names."""
    comm = COMM_ALIASES.get(comm, comm)
    if comm not in COMM_TYPES:
        raise ValueError(f"comm={comm!r} is not a known cp_comm_type; choose one of "
                         f"{', '.join(COMM_TYPES)} (alias: allgather)")
    return comm


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [s_local, b, heads, head_dim] (sbhd), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in s_local, batch and "
                         f"head_dim (dims 0, 1, 3)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads h={q.shape[2]} are not a multiple of key/value heads h_kv={k.shape[2]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_heads(h: int, h_kv: int, degree: int, comm: str) -> None:
    """Raise a ValueError unless ``h`` query and ``h_kv`` key/value heads split over an all-to-all of ``degree``."""
    if h % degree:
        raise ValueError(f"query heads h={h} are not divisible by the all-to-all degree {degree} "
                         f"(comm={comm!r}); use a degree that divides {h}, or comm='p2p'")
    if h_kv >= degree and h_kv % degree:
        raise ValueError(f"key/value heads h_kv={h_kv} are not divisible by the all-to-all degree {degree} "
                         f"(comm={comm!r}); use a degree that divides {h_kv}")
    if h_kv < degree and degree % h_kv:
        raise ValueError(f"key/value heads h_kv={h_kv} cannot be replicated evenly over the all-to-all degree "
                         f"{degree} (comm={comm!r}); use a degree that is a multiple of {h_kv}")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Union[HCPGroups, ProcessGroup, None],
    causal: bool = True,
    layout: str = "zigzag",
    comm: str = "a2a+p2p",
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
):
    """Exact attention over a sequence sharded across the context-parallel ranks of ``groups``.

    ``q [s_local, b, h, d]``, ``k, v [s_local, b, h_kv, d]`` are this rank's shards under ``layout``
    (see ``shard_sequence``); the result ``[s_local, b, h, d]`` has q's dtype and is differentiable
    in q, k, v. With ``return_lse`` also the log-sum-exp ``[s_local, b, h]`` (fp32; fp64 for fp64).
    ``groups``: ``HCPGroups`` (``build_hcp_groups``), or a process group for a flat CP group.
    ``dropout_p``: attention dropout; masks come from ``dropout_seed`` (default: drawn from torch's
    generator) mixed with the CP rank, ring step and block, so a seed replays the same masks.
    """
    comm = normalize_comm(comm)
    check_layout(layout)
    _check_qkv(q, k, v)
    if not isinstance(groups, HCPGroups):
        groups = HCPGroups.flat(groups)
    if comm == "a2a+p2p" and len(groups.sizes) < 2:
        raise ValueError(f"comm='a2a+p2p' needs hierarchical groups of at least two levels, got "
                         f"hierarchical_context_parallel_sizes={list(groups.sizes)}; build them with "
                         f"build_hcp_groups([inner, outer]) or use comm='a2a' or 'p2p'")
    check_seq_len(q.shape[0] * groups.cp_size, groups.cp_size, layout)
    check_heads(q.shape[2], k.shape[2], a2a_degree(comm, groups), comm)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kernel = get_kernel(backend, q.device, q.dtype, dropout=dropout_p > 0)
    return context_parallel_forward(q, k, v, groups, comm, layout, causal, kernel, scale, return_lse,
                                    dropout_p, dropout_seed or 0)
