"""Block attention kernels: ``(q, k, v, causal) -> (out, lse)`` on one device, and their backward.

``base`` says what a kernel is and declares (``Kernel``, ``Capabilities``); ``math`` is the pure-torch
reference; ``torch_sdpa`` wraps PyTorch's fused SDPA ops; ``te`` is Transformer Engine's reserved slot;
``registry`` probes which of them serve this machine and picks one (``get_kernel``).
``python -m mcp_context.kernels`` prints that choice and every refusal's reason.
"""
from .base import (BLOCK_MASKS, FLOAT_DTYPES, Capabilities, Dropout, Kernel, accum_dtype, finite_lse_for_backward,
                   fold_rows)
from .registry import BACKENDS, SizeDispatchKernel, Verdict, check_backend, get_kernel, kernel_report, probe

__all__ = ["BLOCK_MASKS", "BACKENDS", "FLOAT_DTYPES", "Capabilities", "Dropout", "Kernel", "SizeDispatchKernel",
           "Verdict", "accum_dtype", "check_backend", "finite_lse_for_backward", "fold_rows", "get_kernel",
           "kernel_report", "probe"]
