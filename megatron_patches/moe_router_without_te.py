"""The MoE router without Transformer Engine: megatron-core 0.16.x's `router_gating_linear` crashes.

`megatron.core.transformer.moe.moe_utils` imports ``te_general_gemm`` only when its TE import
succeeds, but `RouterGatingLinearFunction.forward`/`backward` test ``te_general_gemm is not None``
unconditionally, so without TE every MoE router raises ``NameError: name 'te_general_gemm' is not
defined``. The patch defines the missing name as None (the functions' own "no TE" value: they then
use torch's matmul); with TE installed the probe finds the name and does nothing. Applied on every
device (a GPU machine without TE has the same crash).
"""
from __future__ import annotations

from megatron.core.transformer.moe import moe_utils


def apply_moe_router_without_te() -> list[str]:
    """Define ``moe_utils.te_general_gemm = None`` where the module lacks it (idempotent); returns the
    qualified names set by this call."""
    if hasattr(moe_utils, "te_general_gemm"):
        return []
    moe_utils.te_general_gemm = None
    return [f"{moe_utils.__name__}.te_general_gemm"]
