"""Which block kernel serves a (device, dtype): declared capabilities, then a probe, then a choice.

Backends: ``math`` (pure torch, always serves), the fused torch ops ``torch:cpu_flash``,
``torch:cudnn``, ``torch:flash``, ``torch:efficient``, and ``te`` (a reserved slot that refuses
loudly). A backend whose declared ``Capabilities`` exclude the request is not tried; one that may
serve is probed once per (device type, dtype, head_dim): a small GQA causal block and a rectangular
full block, forward and backward from the final ``(out, lse)``, against the math kernel. *Any*
exception or disagreement means "does not serve here", and the reason is kept for
``python -m mcp_context.kernels`` and for error messages.

``auto`` takes the fastest op that serves: on CUDA cuDNN for the blocks long contexts have and flash
for blocks of at most ``SMALL_BLOCK_ROWS`` rows when both serve (H100, bf16, d=128, causal fwd+bwd:
flash 68 vs cuDNN 56 TFLOP/s at 1K rows, cuDNN ahead from 2K on: 206 vs 166, 511 vs 280 at 8K),
then efficient, then math; on the CPU ``cpu_flash``, then math. With dropout only the math kernel
can replay a block's mask.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Capabilities, Kernel
from .math import MathKernel
from .te import TEKernel
from .torch_sdpa import FUSED_OPS, TorchKernel

FUSED_NAMES = tuple(f"torch:{name}" for name in FUSED_OPS)
BACKENDS = ("auto", "math", "torch") + FUSED_NAMES + ("te",)
AUTO_ORDER = {"cpu": ("torch:cpu_flash",), "cuda": ("torch:cudnn", "torch:flash", "torch:efficient")}
SMALL_BLOCK_ROWS = 1024
PROBE_HEAD_DIM = 16


@dataclass(frozen=True)
class Verdict:
    """Whether backend ``name`` serves a (device, dtype): the kernel, or the reason it does not."""

    name: str
    kernel: Optional[Kernel]
    reason: Optional[str] = None


class SizeDispatchKernel:
    """Two kernels that both serve, each taking the blocks it is faster on (decided by block rows,
    so a block's backward always runs on the kernel that ran its forward)."""

    def __init__(self, small: Kernel, large: Kernel, max_small_rows: int = SMALL_BLOCK_ROWS):
        self.small, self.large, self.max_small_rows = small, large, max_small_rows
        self.name = f"{large.name}+{small.name.split(':')[-1]}<={max_small_rows}"
        self.capabilities: Capabilities = large.capabilities

    def _pick(self, q: torch.Tensor, k: torch.Tensor) -> Kernel:
        return self.small if max(q.shape[2], k.shape[2]) <= self.max_small_rows else self.large

    def forward(self, q, k, v, causal, scale, dropout=None):
        return self._pick(q, k).forward(q, k, v, causal, scale, dropout)

    def backward(self, dout, q, k, v, out, lse, causal, scale, dropout=None):
        return self._pick(q, k).backward(dout, q, k, v, out, lse, causal, scale, dropout)


_VERDICTS: dict[tuple, Verdict] = {}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _disagreement(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """None when ``kernel`` matches the math kernel on this device and dtype, else what differed."""
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    math_kernel = MathKernel()
    for causal, sq, sk in ((True, 40, 40), (False, 40, 24)):
        q, dout = (torch.randn(1, 4, sq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        k, v = (torch.randn(1, 2, sk, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        scale = head_dim ** -0.5
        ref_out, ref_lse = math_kernel.forward(q, k, v, causal, scale)
        merged_out = ref_out.to(dtype)
        got = kernel.forward(q, k, v, causal, scale)
        grads = kernel.backward(dout, q, k, v, merged_out, ref_lse, causal, scale)
        ref_grads = math_kernel.backward(dout, q, k, v, merged_out, ref_lse, causal, scale)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), tuple(got) + tuple(grads), (ref_out, ref_lse)
                              + tuple(ref_grads)):
            if a.shape != b.shape:
                return f"{what} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            err = (a.float() - b.float()).abs().max().item()
            if not err <= tol * (1 + b.float().abs().max().item()):
                return (f"disagrees with the math kernel ({'causal' if causal else 'full'} block {sq}x{sk}): "
                        f"max error {err:.2e} in {what}, tolerance {tol:.0e}")
    return None


def probe(name: str, device: torch.device, dtype: torch.dtype, dropout: bool = False,
          head_dim: int = PROBE_HEAD_DIM) -> Verdict:
    """Whether backend ``name`` (``math``, ``torch:<op>`` or ``te``) serves here; cached per process."""
    key = (name, device.type, dtype, dropout, head_dim)
    if key in _VERDICTS:
        return _VERDICTS[key]
    if name == "te":
        try:
            kernel: Kernel = TEKernel(device, dtype)
            verdict = Verdict(name, kernel)
        except Exception as err:  # noqa: BLE001 - any failure means TE does not serve here
            verdict = Verdict(name, None, _first_line(err))
    else:
        kernel = MathKernel() if name == "math" else TorchKernel(FUSED_OPS[name.split(":", 1)[1]])
        reason = None if name == "math" else refusal(kernel, device, dtype, dropout, head_dim)
        verdict = Verdict(name, kernel if reason is None else None, reason)
    _VERDICTS[key] = verdict
    return verdict


def refusal(kernel: Kernel, device: torch.device, dtype: torch.dtype, dropout: bool = False,
            head_dim: int = PROBE_HEAD_DIM) -> Optional[str]:
    """Why ``kernel`` does not serve here (its declared capabilities, then a probe run), or None.

    Any exception the probe raises, of any type, is a refusal with its first line as the reason."""
    reason = kernel.capabilities.refusal(device, dtype, dropout)
    if reason is None and device.type != "meta":
        try:
            reason = _disagreement(kernel, device, dtype, head_dim)
        except Exception as err:  # noqa: BLE001 - any exception means "does not serve here"
            reason = _first_line(err)
    return reason


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known; choose one of {', '.join(BACKENDS)}")


def _fastest_fused(device: torch.device, dtype: torch.dtype, head_dim: int) -> Optional[Kernel]:
    serving = {n: v.kernel for n in AUTO_ORDER.get(device.type, ())
               if (v := probe(n, device, dtype, head_dim=head_dim)).kernel is not None}
    if "torch:cudnn" in serving and "torch:flash" in serving:
        return SizeDispatchKernel(small=serving["torch:flash"], large=serving["torch:cudnn"])
    return next(iter(serving.values()), None)


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, dropout: bool = False,
               head_dim: int = PROBE_HEAD_DIM) -> Kernel:
    """The kernel for ``backend`` on this device and dtype (``auto``: the fastest op that serves).

    A named op that does not serve raises a ValueError with the probe's reason; ``torch`` (any fused
    op) warns and uses the math kernel when none serves; ``auto`` uses it silently."""
    check_backend(backend)
    if backend == "te":
        return TEKernel(device, dtype)
    if backend == "math" or (backend == "auto" and dropout):
        return MathKernel()
    if dropout:
        raise ValueError(f"backend={backend!r} cannot apply attention dropout inside the ring (the fused ops draw "
                         f"their own masks); use backend='auto' or 'math', or dropout 0")
    if backend in FUSED_NAMES:
        verdict = probe(backend, device, dtype, head_dim=head_dim)
        if verdict.kernel is None:
            raise ValueError(f"backend={backend!r} does not serve {dtype} on {device.type} here: {verdict.reason}; "
                             f"use backend='auto' (see `python -m mcp_context.kernels`)")
        return verdict.kernel
    fused = _fastest_fused(device, dtype, head_dim)
    if fused is not None:
        return fused
    if backend == "torch":
        warnings.warn(f"no fused torch attention op supports {dtype} on {device.type}; using the math kernel "
                      f"(see `python -m mcp_context.kernels` for why)", stacklevel=2)
    return MathKernel()


def kernel_report(device: torch.device, dtype: torch.dtype, head_dim: int = PROBE_HEAD_DIM) -> dict:
    """What ``auto`` picks here and, for every backend, whether it serves and why not."""
    verdicts = [probe(name, device, dtype, head_dim=head_dim) for name in ("math",) + FUSED_NAMES + ("te",)]
    return {"device": device.type, "dtype": str(dtype).replace("torch.", ""),
            "auto": get_kernel("auto", device, dtype, head_dim=head_dim).name,
            "backends": {v.name: "serves" if v.kernel is not None else v.reason for v in verdicts}}
