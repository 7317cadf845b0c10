"""mcp_context: hierarchical context-parallel attention for Megatron-Core.

Public contract (stable names): ``context_parallel_attention``, ``shard_sequence``,
``unshard_sequence``, ``build_hcp_groups`` (and ``HCPGroups``, ``shard_positions``, and
``ContextParallelAttention``, the engine a model layer holds, and ``engine_for``, the shared store of
engines). Masks as values: ``Full``, ``Causal``, ``SlidingWindow``, ``documents_mask`` (packed).
"""
from .api import context_parallel_attention, engine_for
from .comm import HCPGroups, build_hcp_groups
from .cp_rules import LAYOUTS, normalize_comm
from .engine import ContextParallelAttention
from .layouts import shard_positions, shard_sequence, unshard_sequence
from .masks import Causal, Full, SlidingWindow, documents_mask
from .trace import comm_stats

__all__ = ["context_parallel_attention", "ContextParallelAttention", "engine_for", "normalize_comm", "HCPGroups",
           "build_hcp_groups", "comm_stats", "LAYOUTS", "shard_positions", "shard_sequence", "unshard_sequence",
           "Full", "Causal", "SlidingWindow", "documents_mask"]
