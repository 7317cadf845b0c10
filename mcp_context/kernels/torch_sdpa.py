"""Fused block attention through PyTorch's SDPA aten ops that return a real log-sum-exp.

One ``FusedOp`` per aten op pair, each called exactly as its schema asks (checked against torch 2.11
on an H100 and torch 2.13 on CPU; ``tests/test_kernels.py`` runs every CUDA call on ``meta`` tensors
so a wrong argument list fails on any machine):

- ``cpu_flash``: ``_scaled_dot_product_flash_attention_for_cpu`` (fp64/fp32/bf16/fp16, GQA native).
- ``cudnn``: ``_scaled_dot_product_cudnn_attention`` (bf16/fp16, GQA native; lse ``[b, h, s, 1]``;
  backward with ``attn_bias=None``, ``cum_seq=None`` and int64 scalar philox tensors).
- ``flash``: ``_scaled_dot_product_flash_attention`` (bf16/fp16, GQA native; backward with
  ``cum_seq=None`` — empty tensors would make it a varlen call — and uint64 philox tensors).
- ``efficient``: ``_scaled_dot_product_efficient_attention`` (needs equal head counts: K/V heads are
  repeated locally, after communication, and their gradients summed back in fp32).

Each op computes ``full`` blocks and ``causal`` squares; an ``anticausal`` square (key ``b >= a``, the
lower edge of a sliding window) is a causal square of the blocks with their rows reversed, so it runs
on the same op with the rows flipped (copies of O(s·d), against O(s^2·d) compute). A mask with
``diagonal = g > 1`` (a narrow window's squares, ``masks.BlockMask``) runs as one call with the ``g``
squares folded into the batch dimension (a view for one sequence, else a copy of O(s·d)); an anticausal
run is flipped once, whole (a run of anticausal squares reversed is a run of causal ones).

Every op reads ``[b, h, s, d]`` views of the executor's ``[s, b, h, d]`` storage (a permute, no
copy); only a last dimension that is not contiguous is copied (the CPU op silently misreads it).
One exception: the efficient op's backward reads ``out`` (and ``dout``) as if packed ``[b, s, h, d]``
(its row stride is wired to ``h * d``: a ``[b, h, s, d]``-packed ``out`` gave wrong half-precision dq/dk on
an H100 and read past the end of ``out``), so both are handed to it bshd-packed, copied if they are not.
Whether an op serves a device and dtype is the registry's probe's call, never a version string.

Value head dims other than the query/key one (MLA, ``Capabilities.distinct_v_dim``): the CPU op refuses
them ("Q/K/V should have the same head size", torch 2.13); flash requires equal head dims (PyTorch's
``check_head_dim_size_flash``, and its shape function gives ``out`` q's head dim); cuDNN takes them
(PyTorch #128350; its shape functions give ``out``/dV v's head dim), checked by the probe on a GPU; the
efficient op's shape functions take them but no GPU has checked it, so it declares no.

Copies use ``clone(memory_format=...)`` and slices ``narrow``: under a fake-CUDA rehearsal on a CPU-only
torch, ``Tensor.contiguous()`` and indexing go through a device guard that does not exist there.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch._guards import detect_fake_mode

from ..masks import CAUSAL_BLOCK, block_mask
from .base import Capabilities, Dropout, accum_dtype, fold_rows

aten = torch.ops.aten
_HALF = frozenset({torch.bfloat16, torch.float16})
_MASKS = frozenset({"full", "causal", "anticausal"})


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous (copied only if it is not)."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride in the last dimension (what every fused op assumes)."""
    return x if x.stride(-1) == 1 else _packed(x)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: itself where it already is (``Tensor.to`` costs the host a dispatch even then)."""
    return x if x.dtype == dtype else x.to(dtype)


def _bshd_packed(x: torch.Tensor) -> torch.Tensor:
    """``x [b, h, s, d]`` as a view of ``[b, s, h, d]``-contiguous storage (copied only if it is not)."""
    return _packed(x.transpose(1, 2)).transpose(1, 2)


def _repeat_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    return x if x.shape[1] == h else x.repeat_interleave(h // x.shape[1], dim=1)


def _unfold(x: torch.Tensor, g: int) -> torch.Tensor:
    """The inverse of ``fold_rows``: ``[g*b, h, s, ...] -> [b, h, g*s, ...]`` (a view of a bshd-packed
    ``out`` when ``b == 1``; copied otherwise)."""
    return x.unflatten(0, (g, x.shape[0] // g)).movedim(0, 2).flatten(2, 3)


def _sum_kv_groups(dx: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share a KV head, in fp32 (fp64 for fp64)."""
    b, h, s, d = dx.shape
    if h == h_kv:
        return dx
    acc = torch.float64 if dx.dtype == torch.float64 else torch.float32
    return dx.reshape(b, h_kv, h // h_kv, s, d).sum(2, dtype=acc)


def _cpu_forward(q, k, v, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


def _flash_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


_ZEROS: dict = {}
_FAKE_ZEROS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor made once per (shape, dtype, device) and shared by every backward call (the ops
    only read their philox seed and offset; without dropout they are zero): no fill kernel per call.
    Under a fake-tensor rehearsal the cache belongs to that fake mode, so no fake tensor outlives it."""
    mode = detect_fake_mode()
    cache = _ZEROS if mode is None else _FAKE_ZEROS.setdefault(mode, {})
    key = (shape, dtype, device)
    if key not in cache:
        cache[key] = torch.zeros(shape, dtype=dtype, device=device)
    return cache[key]


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    seed = _zeros((2,), torch.uint64, q.device)
    offset = _zeros((), torch.uint64, q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, _packed(lse), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=scale)


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    seed = offset = _zeros((), torch.int64, q.device)
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, _packed(lse.unsqueeze(-1)), seed, offset, None, None, None, q.shape[2], k.shape[2],
        0.0, causal, scale=scale)


def _efficient_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse.narrow(-1, 0, q.shape[2])  # some builds pad the LSE to a multiple of 32 rows


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    """``out`` and ``dout`` go in bshd-packed: the kernel reads them with a row stride of ``h * d``."""
    dout, out = _bshd_packed(dout), _bshd_packed(out)
    seed = offset = _zeros((), torch.int64, q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, _packed(lse), seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


@dataclass(frozen=True)
class FusedOp:
    """One aten forward/backward pair and what it declares it supports."""

    name: str
    capabilities: Capabilities
    forward: Callable
    backward: Callable


FUSED_OPS: dict[str, FusedOp] = {op.name: op for op in (
    FusedOp("cpu_flash", Capabilities(frozenset({"cpu"}), _HALF | {torch.float64, torch.float32}, native_gqa=True,
                                      masks=_MASKS, distinct_v_dim=False), _cpu_forward, _cpu_backward),
    FusedOp("cudnn", Capabilities(frozenset({"cuda"}), _HALF, native_gqa=True, masks=_MASKS, distinct_v_dim=True),
            _cudnn_forward, _cudnn_backward),
    FusedOp("flash", Capabilities(frozenset({"cuda"}), _HALF, native_gqa=True, masks=_MASKS, distinct_v_dim=False),
            _flash_forward, _flash_backward),
    FusedOp("efficient", Capabilities(frozenset({"cuda"}), _HALF | {torch.float32}, native_gqa=False, masks=_MASKS,
                                      distinct_v_dim=False),
            _efficient_forward, _efficient_backward),
)}


class TorchKernel:
    """A ``FusedOp`` as a block kernel; ``name`` says which (``torch:cpu_flash``, ``torch:cudnn``, ...)."""

    def __init__(self, op: FusedOp):
        self.op, self.name, self.capabilities = op, f"torch:{op.name}", op.capabilities

    def __repr__(self) -> str:
        return f"TorchKernel({self.name})"

    def _causal(self, mask, q: torch.Tensor, k: torch.Tensor) -> bool:
        """The op's ``is_causal`` for ``mask`` (``full`` or a ``causal`` square); ValueError otherwise."""
        kind = block_mask(mask).kind
        if kind not in ("full", "causal") or (kind == "causal" and q.shape[2] != k.shape[2]):
            raise ValueError(f"{self.name} computes full blocks and square causal blocks, not a {kind} mask on a "
                             f"{q.shape[2]}x{k.shape[2]} block; the schedule splits other masks for it "
                             f"(build it with this kernel's capabilities.masks) or use backend='math'")
        return kind == "causal"

    def forward(self, q, k, v, mask, scale, dropout: Optional[Dropout] = None):
        if dropout is not None:
            raise ValueError(f"{self.name} cannot replay a per-block dropout mask; use the math kernel")
        m = block_mask(mask)
        if m.kind == "anticausal":  # key b >= a: causal on the rows reversed (a run of
            # anticausal squares reversed is a run of causal squares, in reverse order: one flip each way)
            out, lse = self.forward(q.flip(2), k.flip(2), v.flip(2), replace(CAUSAL_BLOCK, diagonal=m.diagonal), scale)
            return out.flip(2), lse.flip(-1)
        if m.diagonal > 1:  # equal squares along the diagonal: one call with the squares as batch entries
            g = m.diagonal
            out, lse = self.forward(*(fold_rows(x, g) for x in (q, k, v)), replace(m, diagonal=1), scale)
            return _unfold(out, g), _unfold(lse, g)
        causal = self._causal(m, q, k)
        if not self.capabilities.native_gqa:
            h = q.shape[1]
            k, v = _repeat_kv(k, h), _repeat_kv(v, h)
        return self.op.forward(_dense_last(q), _dense_last(k), _dense_last(v), causal, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale, dropout: Optional[Dropout] = None):
        if dropout is not None:
            raise ValueError(f"{self.name} cannot replay a per-block dropout mask; use the math kernel")
        m = block_mask(mask)
        if m.kind == "anticausal":
            grads = self.backward(*(x.flip(2) for x in (dout, q, k, v, out)), lse.flip(-1),
                                  replace(CAUSAL_BLOCK, diagonal=m.diagonal), scale)
            return tuple(x.flip(2) for x in grads)
        if m.diagonal > 1:
            g = m.diagonal
            grads = self.backward(*(fold_rows(x, g) for x in (dout, q, k, v, out, lse)), replace(m, diagonal=1),
                                  scale)
            return tuple(_unfold(x, g) for x in grads)
        causal = self._causal(m, q, k)
        h, h_kv, dtype = q.shape[1], k.shape[1], q.dtype
        if not self.capabilities.native_gqa:
            k, v = _repeat_kv(k, h), _repeat_kv(v, h)
        dq, dk, dv = self.op.backward(_dense_last(_as(dout, dtype)), _dense_last(q), _dense_last(k), _dense_last(v),
                                      _dense_last(_as(out, dtype)), _as(lse, accum_dtype(dtype)), causal, scale)
        return dq, _sum_kv_groups(dk, h_kv), _sum_kv_groups(dv, h_kv)


def cpu_flash_kernel() -> TorchKernel:
    """The CPU fused op as a kernel, without probing (the planner's dry run uses it on meta tensors)."""
    return TorchKernel(FUSED_OPS["cpu_flash"])
