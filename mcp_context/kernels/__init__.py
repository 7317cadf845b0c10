"""Block attention kernels: ``(q, k, v, causal) -> (out, lse)`` on one device, and their backward.

Every kernel takes ``[b, h, s, d]`` tensors (``h`` query heads, ``h_kv`` key/value heads with
``h % h_kv == 0``; GQA is handled inside, never by repeating KV on the wire) and only two mask forms,
which the schedule guarantees: ``causal=False`` (every key visible) and ``causal=True`` on a square
block (query ``i`` sees keys ``0..i``). The backward recomputes the block from the *final* merged
``(out, lse)`` of the whole attention, as flash-attention does, so nothing O(s^2) is kept.

Backends: ``math`` (pure torch, any device/dtype, the reference), ``torch`` (the fused SDPA aten ops
that return a real LSE), ``te`` (Transformer Engine, a reserved slot). ``get_kernel`` picks one by
probing what the installed torch can do on this device and dtype, never by version strings.
"""
from __future__ import annotations

from typing import Protocol

import torch

BACKENDS = ("auto", "math", "torch", "te")


class Kernel(Protocol):
    """What the ring executor needs from a block-attention backend."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``out [b, h, sq, d]`` and ``lse [b, h, sq]`` (fp32, or fp64 for fp64 input)."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``dq, dk, dv`` for this block given the final merged ``out`` and ``lse``."""


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Turn ``-inf`` (fully masked rows) into ``+inf`` so ``exp(score - lse)`` is 0, never NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> Kernel:
    """The kernel for ``backend`` on this device and dtype (``auto``: the fused op when it works)."""
    from .math import MathKernel
    from .te import TEKernel
    from .torch_sdpa import TorchKernel

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; choose one of {', '.join(BACKENDS)}")
    if backend == "math":
        return MathKernel()
    if backend == "te":
        return TEKernel(device, dtype)
    fused = TorchKernel.probe(device, dtype)
    if fused is not None:
        return fused
    if backend == "torch":
        # The contract: the math kernel covers what no fused op can do (e.g. fp64 on CUDA).
        import warnings

        warnings.warn(f"no fused torch attention op supports {dtype} on {device.type}; "
                      f"using the math kernel", stacklevel=3)
    return MathKernel()
