"""Megatron-Core integration: core attention, layer specs, config validation, CP batches and loss.

The names load on first use (PEP 562): ``mcp_context.megatron.config`` (the CP checks recipes run)
imports without megatron-core, which takes seconds to import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_HOME = {"masked_token_mean": ".batch", "slice_batch_for_cp": ".batch", "HCPConfigError": ".config",
         "normalize_cp_comm_type": ".config", "validate_cp_config": ".config",
         "HCPDotProductAttention": ".core_attention", "get_gpt_layer_hcp_spec": ".specs"}
"""Public name -> the module that defines it."""
__all__ = list(_HOME)


__getattr__, __dir__ = lazy_exports(__name__, _HOME, globals())

if TYPE_CHECKING:
    from .batch import masked_token_mean, slice_batch_for_cp
    from .config import HCPConfigError, normalize_cp_comm_type, validate_cp_config
    from .core_attention import HCPDotProductAttention
    from .specs import get_gpt_layer_hcp_spec
