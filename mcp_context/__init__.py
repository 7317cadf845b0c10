"""mcp_context: hierarchical context-parallel attention for Megatron-Core.

Public contract (stable names): ``context_parallel_attention``, ``shard_sequence``,
``unshard_sequence``, ``build_hcp_groups`` (and ``HCPGroups``, ``shard_positions``, and
``ContextParallelAttention``, the engine a model layer holds).
"""
from .api import context_parallel_attention
from .comm import HCPGroups, build_hcp_groups
from .cp_rules import LAYOUTS, normalize_comm
from .engine import ContextParallelAttention
from .layouts import shard_positions, shard_sequence, unshard_sequence
from .trace import comm_stats

__all__ = ["context_parallel_attention", "ContextParallelAttention", "normalize_comm", "HCPGroups", "build_hcp_groups", "comm_stats",
           "LAYOUTS", "shard_positions", "shard_sequence", "unshard_sequence"]
