"""The functional API: ``context_parallel_attention`` — the engine for this configuration, run once.

``engine_for`` is the one store of engines: one per configuration (the last 64), shared by every
caller with that configuration (repeated functional calls, and every Megatron layer of a model with the
same attention), so what an engine resolves (kernel, schedule, peers, a packing's scheme) is resolved
once. Nothing below it caches: an engine owns its schemes (see ``engine.py`` for its bound).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .comm import HCPGroups
from .engine import ContextParallelAttention
from .masks import Documents, Mask


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
    check_ranks: Optional[bool] = None,
    window_size: Optional[tuple[int, int]] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_padded: Optional[torch.Tensor] = None,
    softmax_offset: Optional[torch.Tensor] = None,
    mask: Optional[Mask] = None,
    step_graphs: bool = False,
):
    """Exact attention over a sequence sharded across the context-parallel ranks of ``groups``.

    ``q [s_local, b, h, d]``, ``k [s_local, b, h_kv, d]``, ``v [s_local, b, h_kv, dv]`` are this rank's
    shards under ``layout`` (see ``shard_sequence``); ``dv`` may differ from ``d`` (MLA: DeepSeek-V3's
    192 and 128). The result ``[s_local, b, h, dv]`` has q's dtype and is differentiable in q, k, v.
    With ``return_lse`` also the log-sum-exp ``[s_local, b, h]`` (fp32; fp64 for fp64).
    ``softmax_offset [h]``: attention sinks (gpt-oss; Megatron's ``softmax_type='learnable'``, zeros
    for ``'off-by-one'``): head ``n``'s softmax gets one more logit ``softmax_offset[n]`` with no value,
    in every query row (every document's), so ``lse`` includes it. Differentiable: the gradient that
    comes back is this rank's share (its rows); summing it over the CP ranks gives the sink's gradient
    (Megatron's gradient all-reduce over data x context parallel ranks does that).
    ``groups``: ``HCPGroups`` (``build_hcp_groups``), or a process group for a flat CP group.
    ``backend``: ``auto``, ``math``, ``torch`` (any fused op), a named op (``torch:cudnn``,
    ``torch:flash``, ``torch:efficient``, ``torch:cpu_flash``) or ``te``.
    ``dropout_p``: attention dropout; masks come from ``dropout_seed`` (default: drawn from torch's
    generator) mixed with the CP rank, ring step and block, so a seed replays the same masks.
    ``window_size=(left, right)``: sliding-window attention (Megatron/TE semantics): query ``i`` sees
    keys ``j`` with ``i - left <= j <= i + right``; ``-1`` leaves a side unbounded; ``causal=True``
    caps ``right`` at 0; ``None`` or ``(-1, -1)`` is plain causal or full attention. Ring steps whose
    keys no local query can see are not computed.
    ``cu_seqlens``: a packed sequence (Megatron/TE ``thd`` semantics): a global int32 tensor
    ``[n_docs + 1]`` of the documents' cumulative lengths; ``cu_seqlens_padded`` (optional) their
    offsets in the sequence when each is followed by padding rows. Then ``b = 1`` (``q [s_local, 1, h,
    d]``), no query sees another document (``causal`` and ``window_size`` apply inside each), padding
    rows see nothing, are seen by nothing and get zero gradients (``out`` 0, ``lse`` ``-inf``), and
    ring steps and blocks no query of a document reaches are skipped. ``layout="zigzag"`` is then the
    per-document zigzag of Megatron/TE (each document padded to a multiple of ``2 * cp``);
    ``layout="balanced"`` places documents so the causal work is balanced with no per-document padding
    (the sequence length a multiple of ``cp``). Shard with ``shard_sequence(..., cu_seqlens=...)``.
    ``mask``: the mask as a value instead of ``causal``/``window_size``/``cu_seqlens``: ``Full()``,
    ``Causal()``, ``SlidingWindow(left, right)``, or ``documents_mask(cu_seqlens, cu_seqlens_padded,
    within=...)`` for a packed sequence (built once per step, it spares every call the parse).
    ``check_ranks``: check that all CP ranks agree on shapes and configuration first (default: on
    for gloo groups, off for NCCL unless ``MCP_CONTEXT_CHECK_RANKS=1``).
    ``step_graphs``: replay this rank's attention step from CUDA graphs captured once per shard shape
    (``algorithms/graphs.py``), so the host issues one launch where it issued every call, merge and sum: for
    short shards, where the host falls behind the GPU. CUDA only, for the comm types whose K/V are local to
    the step (``a2a``, ``all_gather``, ``a2a+all_gather``), without dropout or packed documents; anything
    else is refused. Not yet run on a GPU.
    """
    documents = None
    if isinstance(mask, Documents):
        if cu_seqlens is not None or cu_seqlens_padded is not None:
            raise ValueError("pass either mask=Documents(...) or cu_seqlens/cu_seqlens_padded, not both")
        documents, mask = mask, mask.within
    engine = engine_for(groups, causal=causal, layout=layout, comm=comm, softmax_scale=softmax_scale, backend=backend,
                        dropout_p=dropout_p, check_ranks=check_ranks, window_size=window_size, mask=mask,
                        step_graphs=step_graphs)
    return engine(q, k, v, return_lse=return_lse, dropout_seed=dropout_seed, cu_seqlens=cu_seqlens,
                  cu_seqlens_padded=cu_seqlens_padded, softmax_offset=softmax_offset, documents=documents)


ENGINES_KEPT = 64


def engine_for(groups: Union[HCPGroups, ProcessGroup, None], **config) -> ContextParallelAttention:
    """The engine for ``groups`` and ``config`` (``ContextParallelAttention``'s keyword arguments), shared
    by every caller with the same configuration; ``groups=None`` is the default group, by identity (a
    re-initialised one gets a new engine). The last ``ENGINES_KEPT`` configurations are kept."""
    if groups is None:
        groups = dist.group.WORLD
    if isinstance(config.get("window_size"), list):
        config["window_size"] = tuple(config["window_size"])
    try:
        return _engine(groups, tuple(sorted(config.items())))
    except TypeError:  # an unhashable (so invalid) value: the engine's own checks name it
        return ContextParallelAttention(groups, **config)


@lru_cache(maxsize=ENGINES_KEPT)
def _engine(groups: Union[HCPGroups, ProcessGroup, None], config: tuple) -> ContextParallelAttention:
    return ContextParallelAttention(groups, **dict(config))
