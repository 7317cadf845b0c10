"""mcp_context: hierarchical context-parallel attention for Megatron-Core.

Public contract (stable names): ``context_parallel_attention``, ``shard_sequence``,
``unshard_sequence``, ``build_hcp_groups`` (and ``HCPGroups``, ``shard_positions``, and
``ContextParallelAttention``, the engine a model layer holds, and ``engine_for``, the shared store of
engines). Masks as values: ``Full``, ``Causal``, ``SlidingWindow``, ``documents_mask`` (packed).

The names load on first use (PEP 562): ``import mcp_context.recipes`` and the recipe commands need
neither torch nor the engine, and answer in well under 2 s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

_HOME = {"context_parallel_attention": ".api", "engine_for": ".api", "HCPGroups": ".comm",
         "build_hcp_groups": ".comm", "LAYOUTS": ".cp_rules", "normalize_comm": ".cp_rules",
         "ContextParallelAttention": ".engine", "shard_positions": ".layouts", "shard_sequence": ".layouts",
         "unshard_sequence": ".layouts", "Causal": ".masks", "Full": ".masks", "SlidingWindow": ".masks",
         "documents_mask": ".masks", "comm_stats": ".trace"}
"""Public name -> the module that defines it."""
__all__ = list(_HOME)


__getattr__, __dir__ = lazy_exports(__name__, _HOME, globals())

if TYPE_CHECKING:
    from .api import context_parallel_attention, engine_for
    from .comm import HCPGroups, build_hcp_groups
    from .cp_rules import LAYOUTS, normalize_comm
    from .engine import ContextParallelAttention
    from .layouts import shard_positions, shard_sequence, unshard_sequence
    from .masks import Causal, Full, SlidingWindow, documents_mask
    from .trace import comm_stats
