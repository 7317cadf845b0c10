"""Transformer Engine fused-attention kernel: the reserved slot for TE's cuDNN kernels.

TE's fused attention returns its softmax statistics in a backend-specific auxiliary form; wiring it
to our ``(out, lse)`` contract needs a GPU with TE to verify against the math kernel. Until that is
done this backend refuses loudly rather than pretending. The Megatron layer specs can already use
TE's own ``TEDotProductAttention`` for the ``cp_comm_type`` values TE supports.
"""
from __future__ import annotations

import torch


class TEKernel:
    name = "te"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                "backend='te' needs Transformer Engine, which is not importable here "
                f"({err}); install mcp_context[te] on a CUDA machine or use backend='auto'"
            ) from None
        raise NotImplementedError(
            "backend='te' (Transformer Engine block kernels inside our ring) is not implemented yet; "
            "use backend='torch' (fused SDPA ops) or a TE layer spec with TEDotProductAttention"
        )
