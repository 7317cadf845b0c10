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

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

BACKENDS = ("auto", "math", "torch", "te")


@dataclass(frozen=True)
class Dropout:
    """Attention dropout for one block: probability ``p``; the keep-mask is drawn from ``seed``, so the
    backward (and activation recomputation) regenerates exactly the forward's mask."""

    p: float
    seed: int

    def keep_scaled(self, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``mask / (1 - p)`` with ``mask ~ Bernoulli(1 - p)`` of ``shape``."""
        gen = torch.Generator(device=device).manual_seed(self.seed)
        keep = torch.rand(shape, generator=gen, device=device) >= self.p
        return keep.to(dtype) / (1.0 - self.p)


class Kernel(Protocol):
    """What the ring executor needs from a block-attention backend."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                dropout: Optional[Dropout] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``out [b, h, sq, d]`` and ``lse [b, h, sq]`` (fp32, or fp64 for fp64 input).

        With dropout, ``out`` uses the dropped probabilities and ``lse`` the undropped scores, so
        blocks merge exactly as without dropout."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                 dropout: Optional[Dropout] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``dq, dk, dv`` for this block given the final merged ``out`` and ``lse``."""


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_lse_for_backward(lse: torch.Tensor) -> torch.Tensor:
    """Turn ``-inf`` (fully masked rows) into ``+inf`` so ``exp(score - lse)`` is 0, never NaN."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, dropout: bool = False) -> Kernel:
    """The kernel for ``backend`` on this device and dtype (``auto``: the fused op when it works).

    Attention dropout needs a kernel that can replay its mask per block: the math kernel."""
    from .math import MathKernel
    from .te import TEKernel
    from .torch_sdpa import TorchKernel

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; choose one of {', '.join(BACKENDS)}")
    if backend == "math" or (backend == "auto" and dropout):
        return MathKernel()
    if dropout:
        raise ValueError(f"backend={backend!r} cannot apply attention dropout inside the ring (the fused ops draw "
                         f"their own masks); use backend='auto' or 'math', or dropout 0")
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
