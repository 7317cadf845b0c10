"""``ContextParallelAttention``: one engine per attention configuration, resolved once, called per step.

The engine validates its configuration when built (comm, layout, groups, mask, scale, dropout,
backend) and, the first time it sees a shard shape, resolves everything a call needs — the kernel
(probed for that device, dtype and head dim), this member's schedule row, ring peers and all-to-all
pieces — so a training step only runs it. Engines are shared per configuration (``api.engine_for``:
every Megatron layer with the same attention, and the functional form). An engine is the only owner of
what it resolves: a scheme per shard shape, and per packing the last ``_PACKED_SCHEMES``. A packed
sequence's documents come with each call, best as one ``Documents`` value built once per step
(``documents=``; raw ``cu_seqlens`` are parsed per call).

Before anything collective, every call checks that all CP ranks agree on the shapes, dtypes and
configuration (one all-reduce of a digest; the details are gathered only when they differ): ranks that disagree all raise the same error
instead of aborting inside the communication library or returning a result on one rank. It is on
by default for gloo groups, where it costs under 1 % of a layer (see ``docs/design.md``); on NCCL it
would add a host synchronisation per layer, so it runs there only with ``check_ranks=True`` or
``MCP_CONTEXT_CHECK_RANKS=1``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .algorithms import Scheme, graphs, resolve_scheme
from .comm import HCPGroups
from .cp_rules import (ALL_LAYOUTS, COMM_TYPES, a2a_degree, check_heads, check_layout, check_levels, check_seq_len,
                       normalize_comm)
from .kernels import BACKENDS, FLOAT_DTYPES, check_backend, get_kernel
from .masks import Causal, Documents, Full, Mask, SlidingWindow, attention_mask, documents_mask, packing_digest

_PACKED_SCHEMES = 8  # schemes kept per engine for packings (cu_seqlens) seen last


def _digest(cu_seqlens, cu_seqlens_padded) -> int:
    """A cheap fingerprint of the packing for the ranks' agreement row (0: none; -1: not readable), the
    same in every process (``Documents.digest`` of the offsets)."""
    if cu_seqlens is None:
        return 0
    try:
        values = [tuple(torch.as_tensor(x).reshape(-1).tolist()) if x is not None else None
                  for x in (cu_seqlens, cu_seqlens_padded)]
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return -1
    return packing_digest(*values)


def _all_equal(value: int, group: ProcessGroup, device: Optional[torch.device]) -> bool:
    """Whether every rank of ``group`` holds ``value`` (one all-reduce: the max of ``v`` and of ``-v``)."""
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    return extremes.tolist() == [value, -value]


def _check_device(group: ProcessGroup) -> Optional[torch.device]:
    """Where a check's small tensor must live for ``group``'s backend (NCCL: this rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


def agree_on_documents(documents: Documents, groups: Union[HCPGroups, ProcessGroup, None]) -> Documents:
    """Check once that every CP rank holds the same packing (one all-reduce of its digest), and return the
    value marked as agreed in this CP group, so the engines given it check nothing more: build it once
    per step with ``documents_mask`` and pass it here. Ranks that differ all raise the same ValueError."""
    cp_group = groups.cp_group if isinstance(groups, HCPGroups) else (groups or dist.group.WORLD)
    if documents.agreed_in is cp_group or dist.get_world_size(cp_group) == 1:
        return documents
    digest, device = documents.digest(), _check_device(cp_group)
    if not _all_equal(digest, cp_group, device):
        mine = torch.tensor([digest], dtype=torch.int64, device=device)
        every = mine.new_empty(dist.get_world_size(cp_group))
        dist.all_gather_into_tensor(every, mine, group=cp_group)
        differ = sorted({i for i, d in enumerate(every.tolist()) if d != every[0].item()})
        raise ValueError(f"CP ranks disagree on the packed sequence: cu_seqlens differ (CP ranks {differ} hold other "
                         f"offsets than CP rank 0); every CP rank must pass the same global cu_seqlens and "
                         f"cu_seqlens_padded for one packed sequence")
    return dataclasses.replace(documents, agreed_in=cp_group)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [s_local, b, heads, head_dim], got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be [s_local, b, heads, head_dim] (sbhd), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension, shape {tuple(x.shape)}: every CP rank needs at least "
                             f"one token, one sequence, one head and head_dim >= 1; use fewer CP ranks or a "
                             f"longer sequence")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in s_local, batch and heads (dims 0-2; their head dims may differ, "
                         f"as in MLA), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in s_local, batch and "
                         f"head_dim (dims 0, 1, 3)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads h={q.shape[2]} are not a multiple of key/value heads h_kv={k.shape[2]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_sink(softmax_offset, q: torch.Tensor) -> None:
    """A per-head sink must be a finite float tensor ``[h]`` on q's device."""
    if not isinstance(softmax_offset, torch.Tensor):
        raise TypeError(f"softmax_offset must be a torch.Tensor [heads] (one sink logit per query head; zeros for "
                        f"off-by-one softmax), got {type(softmax_offset).__name__}")
    if tuple(softmax_offset.shape) != (q.shape[2],) or not softmax_offset.is_floating_point():
        raise ValueError(f"softmax_offset must be a float tensor [heads] = [{q.shape[2]}] (the query heads of this "
                         f"call), got shape {tuple(softmax_offset.shape)} dtype {softmax_offset.dtype}; pass the "
                         f"sinks of this rank's heads (per TP partition)")
    if softmax_offset.device != q.device:
        raise ValueError(f"softmax_offset is on {softmax_offset.device} but q is on {q.device}; move it to "
                         f"{q.device}")
    if softmax_offset.device.type != "meta" and not bool(torch.isfinite(softmax_offset).all()):
        raise ValueError("softmax_offset has non-finite values; every sink logit must be finite")


def _band_mask(mask: Mask, window_size) -> Mask:
    """An engine's own mask value: ``Full()``, ``Causal()`` or a ``SlidingWindow`` (documents come per call)."""
    if window_size is not None:
        raise ValueError(f"pass either mask={mask!r} or window_size={window_size!r}, not both; the mask value "
                         f"says everything (SlidingWindow(left, right) for a window)")
    if isinstance(mask, Documents) or not isinstance(mask, (Full, Causal, SlidingWindow)):
        raise TypeError(f"mask={mask!r} must be Full(), Causal() or SlidingWindow(left, right) for an engine; "
                        f"a packed sequence's Documents come with each call (engine(q, k, v, documents=...))")
    return mask


def _code(values: tuple, x) -> int:
    return values.index(x) if x in values else len(values)


def _tensor_row(x) -> list[int]:
    """A tensor's rank, shape (4 slots), dtype code and device-type code; -1s for a non-tensor."""
    if not isinstance(x, torch.Tensor):
        return [-1] * 7
    shape = list(x.shape[:4]) + [-1] * (4 - min(x.dim(), 4))
    return [x.dim(), *shape, _code(FLOAT_DTYPES, x.dtype), _code(("cpu", "cuda", "meta"), x.device.type)]


def _describe(row: list[int]) -> str:
    parts = []
    for i, name in enumerate(("q", "k", "v")):
        ndim, *shape = row[i * 7:i * 7 + 5]
        dtype = FLOAT_DTYPES[row[i * 7 + 5]] if row[i * 7 + 5] < len(FLOAT_DTYPES) else "non-float"
        parts.append(f"{name} {list(shape[:max(ndim, 0)])} {str(dtype).replace('torch.', '')}")
    return ", ".join(parts)


class ContextParallelAttention:
    """Exact attention over a sequence sharded across the CP ranks of ``groups``, resolved once.

    ``engine(q, k, v)`` takes this rank's shards ``q [s_local, b, h, d]``, ``k, v [s_local, b, h_kv, d]``
    under ``layout`` and returns ``[s_local, b, h, d]`` in q's dtype, differentiable in q, k, v. See
    ``context_parallel_attention`` for the arguments.
    """

    def __init__(self, groups: Union[HCPGroups, ProcessGroup, None], causal: bool = True, layout: str = "zigzag",
                 comm: str = "a2a+p2p", softmax_scale: Optional[float] = None, backend: str = "auto",
                 dropout_p: float = 0.0, check_ranks: Optional[bool] = None,
                 window_size: Optional[tuple[int, int]] = None, mask: Optional[Mask] = None,
                 step_graphs: bool = False):
        self.comm = normalize_comm(comm)
        if not isinstance(step_graphs, bool):
            raise TypeError(f"step_graphs={step_graphs!r} must be a bool (True replays each shard shape's step from "
                            f"CUDA graphs, algorithms/graphs.py), not {type(step_graphs).__name__}")
        self.step_graphs = step_graphs
        check_layout(layout, packed=True)  # a packed-only layout needs cu_seqlens: checked per call
        if not isinstance(causal, bool):
            raise TypeError(f"causal={causal!r} must be a bool (True for causal attention, False for full), "
                            f"not {type(causal).__name__}")
        self.mask = attention_mask(causal, window_size) if mask is None else _band_mask(mask, window_size)
        causal = self.mask.hides_future
        if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and not isinstance(
                softmax_scale, bool) and math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive finite number (default: "
                             f"1/sqrt(head_dim)); pass None for the default")
        check_backend(backend)
        if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
            raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
        if not isinstance(groups, HCPGroups):
            groups = HCPGroups.flat(groups)
        check_levels(self.comm, groups.sizes)
        self.groups, self.causal, self.layout = groups, causal, layout
        self.softmax_scale, self.backend, self.dropout_p = softmax_scale, backend, float(dropout_p)
        backend_name = dist.get_backend(groups.cp_group)
        if check_ranks is None:
            check_ranks = os.environ.get("MCP_CONTEXT_CHECK_RANKS", "") == "1" or backend_name == "gloo"
        self.check_ranks = check_ranks and groups.cp_size > 1
        self._check_device = _check_device(groups.cp_group)
        self._config = (int(causal), *self.mask.window_size, ALL_LAYOUTS.index(layout), COMM_TYPES.index(self.comm),
                        BACKENDS.index(backend), int(self.dropout_p > 0))
        self._schemes: dict[tuple, Scheme] = {}
        self._packed_keys: list[tuple] = []  # packed schemes, oldest first (at most _PACKED_SCHEMES)

    def check_agreement(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: int = 0,
                        sink: bool = False) -> None:
        """All CP ranks raise the same ValueError when their inputs, configurations or packings differ
        (``packing``: ``_digest`` of cu_seqlens; ``sink``: whether a softmax offset is passed)."""
        row = _tensor_row(q) + _tensor_row(k) + _tensor_row(v) + list(self._config) + [int(sink), packing]
        # One all-reduce of a digest (max of d and of -d: equal everywhere iff every rank has d) in the
        # common case; the rows themselves are gathered only to name what differs.
        digest = int.from_bytes(hashlib.blake2b(repr(row).encode(), digest_size=7).digest(), "little")
        if _all_equal(digest, self.groups.cp_group, self._check_device):
            return
        mine = torch.tensor(row, dtype=torch.int64, device=self._check_device)
        rows = mine.new_empty(self.groups.cp_size * len(row))
        dist.all_gather_into_tensor(rows, mine, group=self.groups.cp_group)
        rows_list = rows.view(self.groups.cp_size, len(row)).tolist()
        if any(r != rows_list[0] for r in rows_list):
            differ = [f"CP rank {i}: {_describe(r)}" + (" (configuration differs)" if r[21:-1] != rows_list[0][21:-1]
                                                         else "")
                      + (" (cu_seqlens differ)" if r[-1] != rows_list[0][-1] else "") for i, r in enumerate(rows_list)]
            raise ValueError("CP ranks disagree on the attention inputs (" + "; ".join(differ) + "); every CP rank "
                             "must pass shards of one shape and dtype, with the same causal/window_size/layout/comm/"
                             "backend and softmax_offset presence (and the same cu_seqlens, cu_seqlens_padded for a packed sequence)")

    def documents(self, q: torch.Tensor, cu_seqlens, cu_seqlens_padded, documents: Optional[Documents] = None
                  ) -> Mask:
        """The mask of a call: this engine's, or with ``cu_seqlens`` (parsed and checked here, fix named) or a
        ``documents`` value (checked once when it was built) its ``Documents`` with this engine's mask inside."""
        if documents is not None:
            if cu_seqlens is not None or cu_seqlens_padded is not None:
                raise ValueError("pass either documents=Documents(...) or cu_seqlens/cu_seqlens_padded, not both")
            if not isinstance(documents, Documents):
                raise TypeError(f"documents must be a Documents value (mcp_context.masks.documents_mask), got "
                                f"{type(documents).__name__}")
            if q.shape[1] != 1 or documents.seq_len != q.shape[0] * self.groups.cp_size:
                raise ValueError(f"documents span {documents.seq_len} rows, but q {tuple(q.shape)} is a shard of "
                                 f"{q.shape[0] * self.groups.cp_size} rows (b must be 1); build them for this sequence")
            return documents if documents.within == self.mask else dataclasses.replace(documents, within=self.mask)
        if cu_seqlens is None:
            if cu_seqlens_padded is not None:
                raise ValueError("cu_seqlens_padded was given without cu_seqlens; pass both (cu_seqlens: the "
                                 "documents' cumulative lengths, cu_seqlens_padded: their padded offsets)")
            check_layout(self.layout)
            return self.mask
        if q.shape[1] != 1:
            raise ValueError(f"a packed sequence (cu_seqlens) is one sequence: q must be [s_local, 1, h, d] (b = 1), "
                             f"got shape {tuple(q.shape)}; pack the batch's documents into one sequence")
        return documents_mask(cu_seqlens, cu_seqlens_padded, within=self.mask, seq_len=q.shape[0] * self.groups.cp_size)

    def scheme(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[Mask] = None) -> Scheme:
        """The resolved scheme for shards shaped like ``q``, ``k`` and ``v`` (built on first use); ``mask``: a
        call's ``Documents`` (schemes of the last few packings are kept)."""
        packed = isinstance(mask, Documents)
        key = (q.shape[0], q.shape[2], k.shape[2], q.shape[3], v.shape[3], q.dtype, q.device) + ((mask,) if packed
                                                                                               else ())
        scheme = self._schemes.get(key)
        if scheme is None:
            cp_size = self.groups.cp_size
            if not packed:  # a packed layout checks the documents it places
                check_seq_len(q.shape[0] * cp_size, cp_size, self.layout)
            inner = a2a_degree(self.comm, self.groups.sizes)
            check_heads(q.shape[2], k.shape[2], inner, self.comm)
            # the kernel sees blocks of at most this rank's rows after the all-to-all, for b * h / inner heads
            kernel = get_kernel(self.backend, q.device, q.dtype, dropout=self.dropout_p, head_dim=q.shape[3],
                                v_head_dim=v.shape[3], rows=q.shape[0] * inner, heads=q.shape[1] * q.shape[2] // inner)
            scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
            scheme = resolve_scheme(self.groups, self.comm, self.layout, mask if packed else self.mask, q.shape[0],
                                    k.shape[2], kernel, scale, self.dropout_p)
            if self.step_graphs:
                scheme = self._graphed(scheme, q.device, packed)
            self._schemes[key] = scheme
            if packed:
                self._packed_keys.append(key)
                if len(self._packed_keys) > _PACKED_SCHEMES:
                    del self._schemes[self._packed_keys.pop(0)]
        return scheme

    def _graphed(self, scheme: Scheme, device: torch.device, packed: bool) -> Scheme:
        """``scheme`` with its step replayed from CUDA graphs (``graphs.StepGraphs``), or the reason it cannot be."""
        why = ("a packed sequence's documents change from batch to batch, and each packing would capture new "
               "graphs" if packed else graphs.refusal(scheme.plan, device))
        if why is not None:
            raise ValueError(f"step_graphs=True with comm={self.comm!r}: {why}; or build the engine with "
                             f"step_graphs=False")
        return dataclasses.replace(scheme, plan=dataclasses.replace(scheme.plan, runner=graphs.StepGraphs()))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False,
                 dropout_seed: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None,
                 cu_seqlens_padded: Optional[torch.Tensor] = None, softmax_offset: Optional[torch.Tensor] = None,
                 documents: Optional[Documents] = None):
        """Attention over this rank's shards; ``cu_seqlens`` (and ``cu_seqlens_padded``), or ``documents``
        (built once per step with ``documents_mask`` and shared by every layer: no parse, no host sync
        per call): the documents of a packed sequence, with this engine's mask inside each;
        ``softmax_offset [h]``: attention sinks (see ``context_parallel_attention``)."""
        if self.check_ranks:
            packing = _digest(cu_seqlens, cu_seqlens_padded) if documents is None else documents.digest()
            self.check_agreement(q, k, v, packing, softmax_offset is not None)
        _check_qkv(q, k, v)
        mask = self.documents(q, cu_seqlens, cu_seqlens_padded, documents)
        if isinstance(mask, Documents) and not self.check_ranks:  # the packing is checked always, once per value
            mask = agree_on_documents(mask, self.groups)
        if softmax_offset is not None:
            _check_sink(softmax_offset, q)
        scheme = self.scheme(q, k, v, mask)
        if self.dropout_p > 0 and dropout_seed is None:
            dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
        return scheme.run(q, k, v, return_lse, dropout_seed or 0, softmax_offset)
