"""Megatron-Core integration: core attention, layer specs, config validation, CP batches and loss."""
from .batch import masked_token_mean, slice_batch_for_cp
from .config import HCPConfigError, normalize_cp_comm_type, validate_cp_config
from .core_attention import HCPDotProductAttention
from .specs import get_gpt_layer_hcp_spec

__all__ = ["HCPConfigError", "HCPDotProductAttention", "get_gpt_layer_hcp_spec", "masked_token_mean",
           "normalize_cp_comm_type", "slice_batch_for_cp", "validate_cp_config"]
