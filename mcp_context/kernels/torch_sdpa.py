"""Fused block attention through PyTorch's SDPA aten ops that return a real log-sum-exp.

CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (GQA native). CUDA: flash, cuDNN and
memory-efficient ops, tried in that order (they need equal head counts, so KV heads are repeated
*locally*, after communication, and their gradients summed back). Which op serves a (device, dtype)
is decided by a probe that runs forward and backward on a tiny GQA causal block and compares with
the math kernel; an op that is missing, raises, or disagrees is not used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .math import MathKernel

aten = torch.ops.aten


def _repeat_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    return x if x.shape[1] == h else x.repeat_interleave(h // x.shape[1], dim=1)


def _sum_kv_groups(dx: torch.Tensor, h_kv: int) -> torch.Tensor:
    b, h, s, d = dx.shape
    return dx if h == h_kv else dx.reshape(b, h_kv, h // h_kv, s, d).sum(2)


def _cpu_forward(q, k, v, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     scale=scale)


def _no_rng(device: torch.device) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=device)


def _flash_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]),
                                                            0.0, causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    h, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    none = torch.empty(0, dtype=torch.int32, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, _repeat_kv(k, h), _repeat_kv(v, h), out, lse, none, none, sq, sk, 0.0, causal,
        _no_rng(q.device), _no_rng(q.device), scale=scale)
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]),
                                                            None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    h, sq, sk = q.shape[1], q.shape[2], k.shape[2]
    none = torch.empty(0, dtype=torch.int32, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, _repeat_kv(k, h), _repeat_kv(v, h), out, lse.unsqueeze(-1).contiguous(), _no_rng(q.device),
        _no_rng(q.device), torch.empty(0, device=q.device), none, none, sq, sk, 0.0, causal, scale=scale)
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


def _efficient_forward(q, k, v, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]  # the op pads its LSE to a multiple of 32 rows


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    h, sq = q.shape[1], q.shape[2]
    padded = torch.nn.functional.pad(lse, (0, -sq % 32))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, h), _repeat_kv(v, h), torch.empty(0, device=q.device), out, padded,
        _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


_OPS: dict[str, list[tuple[str, Callable, Callable]]] = {
    "cpu": [("cpu_flash", _cpu_forward, _cpu_backward)],
    "cuda": [("flash", _flash_forward, _flash_backward), ("cudnn", _cudnn_forward, _cudnn_backward),
             ("efficient", _efficient_forward, _efficient_backward)],
}
_PROBED: dict[tuple[str, torch.dtype], Optional["TorchKernel"]] = {}


@dataclass
class TorchKernel:
    """One fused aten op pair; ``name`` says which (``torch:cpu_flash``, ``torch:flash``, ...)."""

    name: str
    _forward: Callable
    _backward: Callable

    def forward(self, q, k, v, causal, scale, dropout=None):
        assert dropout is None, "get_kernel never gives a fused kernel for dropout"
        return self._forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout=None):
        from . import finite_lse_for_backward

        lse = finite_lse_for_backward(lse).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return self._backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, causal, scale)

    @staticmethod
    def probe(device: torch.device, dtype: torch.dtype) -> Optional["TorchKernel"]:
        """The first fused op that runs and agrees with the math kernel here, or None."""
        key = (device.type, dtype)
        if key not in _PROBED:
            _PROBED[key] = next((kern for name, fwd, bwd in _OPS.get(device.type, [])
                                 if _agrees(kern := TorchKernel(f"torch:{name}", fwd, bwd), device, dtype)), None)
        return _PROBED[key]


def cpu_flash_kernel() -> TorchKernel:
    """The CPU fused op as a kernel, without probing (the planner's dry run uses it on meta tensors)."""
    return TorchKernel("torch:cpu_flash", _cpu_forward, _cpu_backward)


def _agrees(kernel: TorchKernel, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 40, 16, generator=gen).to(device, dtype) for h in (4, 2, 2, 4))
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    try:
        got = kernel.forward(q, k, v, True, 0.25)
        ref = MathKernel().forward(q, k, v, True, 0.25)
        grads = kernel.backward(dout, q, k, v, *ref, True, 0.25)
        ref_grads = MathKernel().backward(dout, q, k, v, *ref, True, 0.25)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    pairs = list(zip(got, ref)) + list(zip(grads, ref_grads))
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in pairs)
