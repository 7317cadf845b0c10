"""Communication layer: process-group topology (``HCPGroups``) and counted primitives."""
from .groups import HCPGroups, build_hcp_groups, level_members
from .primitives import RingExchange, gather_seq, heads_to_seq, seq_to_heads

__all__ = ["HCPGroups", "build_hcp_groups", "level_members", "RingExchange",
           "gather_seq", "heads_to_seq", "seq_to_heads"]
