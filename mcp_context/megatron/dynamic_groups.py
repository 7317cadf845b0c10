"""The groups one sub-sample's attention runs over under dynamic context parallelism.

megatron-core's ``hybrid_context_parallel`` gives each sub-sample its own CP size: its schedule hands the
core attention ``PackedSeqParams(local_cp_size=n, cp_group=...)``, a group of ``n`` adjacent data x context
parallel ranks (``parallel_state.create_hybrid_dp_cp_groups``: every power of two, made once at start-up).
``SubSampleGroups`` turns that into the ``HCPGroups`` and comm scheme our engine runs (the rule is
``cp_rules.dynamic_cp_levels``), checks the group against the sub-sample (size, membership, the
sequence it holds) and keeps the result per group, so each group resolves once and its engines are
reused. It creates no process group: the level-0 (all-to-all) group of a sub-group is one of the groups
made at start-up (``start_up_group_of_size``), so nothing here is collective. Those groups are
megatron-core's (``parallel_state.initialize_model_parallel(hybrid_context_parallel=True)``: powers of
two) or, for our own plan's sizes (any divisor the hierarchy can cut), ``build_sub_groups``'s, kept here
as parallel_state keeps its own.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm import HCPGroups
from ..comm.groups import level_members
from ..cp_rules import a2a_degree, check_heads, dynamic_cp_levels


# build_sub_groups's groups holding this rank: per data x context parallel group, per size
_SUB_GROUPS: dict[ProcessGroup, dict[int, ProcessGroup]] = {}


def build_sub_groups(world_group: ProcessGroup, sizes: Sequence[int]) -> dict[int, ProcessGroup]:
    """Every group of ``size`` adjacent, aligned ranks of ``world_group`` for each of ``sizes`` (1 and the whole
    group need none), created once at start-up by every rank in the same order; keeps and returns, per
    size, the one that holds this rank (the whole group for its own size)."""
    ranks = dist.get_process_group_ranks(world_group)
    me, world = dist.get_rank(), len(ranks)
    mine = {world: world_group}
    for size in sorted(set(sizes)):
        if size in (1, world):
            continue
        for start in range(0, world, size):
            group = dist.new_group(ranks[start:start + size])
            if me in ranks[start:start + size]:
                mine[size] = group
    _SUB_GROUPS[world_group] = mine
    return mine


def start_up_group_of_size(world_group: ProcessGroup, size: int) -> ProcessGroup:
    """The start-up group of ``size`` adjacent ranks of ``world_group`` that holds this rank:
    ``build_sub_groups``'s when it ran for that group, else megatron-core's hybrid DP x CP group."""
    if world_group in _SUB_GROUPS:
        return _SUB_GROUPS[world_group][size]
    from megatron.core import parallel_state

    return parallel_state.get_hybrid_data_context_parallel_groups(group_size=size)


class SubSampleGroups:
    """Resolves ``PackedSeqParams(local_cp_size, cp_group)`` to ``(HCPGroups, comm)``, once per group.

    ``world_group``: the data x context parallel group the sub-samples are spread over; ``level0``: the
    ranks of one all-to-all domain (``hierarchical_context_parallel_sizes[0]``; the whole world when
    None); ``comm``: the configured ``cp_comm_type``; ``single``: this rank alone (a sub-sample of one rank);
    the level-0 group of a sub-group is the start-up group of that many adjacent ranks holding this rank."""

    def __init__(self, world_group: ProcessGroup, level0: Optional[int], comm: str, single: HCPGroups):
        self.world_group = world_group
        self.world_ranks = dist.get_process_group_ranks(world_group)
        self.level0 = level0 if level0 is not None else len(self.world_ranks)
        self.comm, self.single = comm, single
        self._resolved: dict[ProcessGroup, tuple[HCPGroups, str]] = {}

    def check_heads(self, heads: int, kv_heads: int) -> None:
        """A ValueError naming the fix unless the largest group (all the data x context parallel ranks) can split
        ``heads`` query and ``kv_heads`` key/value heads in its all-to-all; a smaller group's degree divides
        that one, so it splits them too."""
        world = len(self.world_ranks)
        sizes, comm = dynamic_cp_levels(world, world, self.level0, self.comm, name="the largest group")
        where = ("hierarchical_context_parallel_sizes[0]" if len(sizes) > 1 or comm != self.comm
                 else "the data x context parallel size")
        check_heads(heads, kv_heads, a2a_degree(comm, sizes), comm, heads_name="query heads per TP rank",
                    kv_name="key/value heads per TP rank", degree_name=f"the all-to-all degree {where}")

    def resolve(self, params: Any, s_local: int) -> tuple[HCPGroups, str]:
        """The groups and comm scheme of the sub-sample ``params`` describes, whose shard on this rank has
        ``s_local`` tokens; a ValueError naming the value and the fix for a group that cannot run it."""
        n, group = params.local_cp_size, params.cp_group
        n = int(n) if isinstance(n, torch.Tensor) else n  # megatron-core's loader hands it over as a tensor
        if group is None:
            if n not in (None, 1):
                raise ValueError(f"packed_seq_params.local_cp_size={n} without a cp_group: pass the group of those "
                                 f"{n} ranks (parallel_state.get_hybrid_data_context_parallel_groups(group_size={n})), "
                                 f"or local_cp_size=1 for a sub-sample on one rank")
            resolved = (self.single, "p2p")
        else:
            size = dist.get_world_size(group)
            if n is not None and size != n:
                raise ValueError(f"packed_seq_params.cp_group has {size} ranks but local_cp_size={n}; pass the group "
                                 f"of local_cp_size ranks (parallel_state.get_hybrid_data_context_parallel_groups("
                                 f"group_size={n})) or set local_cp_size={size}")
            resolved = self._resolved.get(group) or self._resolve_group(group)
        sizes = resolved[0].sizes
        total = getattr(params, "max_seqlen_q", None)
        if total is not None and total != s_local * resolved[0].cp_size:
            raise ValueError(f"packed_seq_params.max_seqlen_q={total}, but this rank holds {s_local} tokens of a "
                             f"sub-sample shared by {resolved[0].cp_size} ranks ({s_local * resolved[0].cp_size} in "
                             f"all, hierarchy {list(sizes)}); shard the sub-sample over its cp_group "
                             f"(megatron.core.utils.get_batch_on_this_hybrid_cp_rank)")
        return resolved

    def _resolve_group(self, group: ProcessGroup) -> tuple[HCPGroups, str]:
        ranks = dist.get_process_group_ranks(group)
        if dist.get_rank() not in ranks:
            raise ValueError(f"packed_seq_params.cp_group holds ranks {ranks}, not this rank {dist.get_rank()}; pass "
                             f"the group of the sub-sample this rank runs")
        outside = sorted(set(ranks) - set(self.world_ranks))
        if outside:
            raise ValueError(f"packed_seq_params.cp_group holds ranks {outside} outside the data x context parallel "
                             f"group {self.world_ranks}; pass a group of its ranks")
        sizes, comm = dynamic_cp_levels(len(ranks), len(self.world_ranks), self.level0, self.comm)
        inner = group if len(sizes) == 1 else self._level0_group(sizes, ranks, dist.get_rank(group))
        self._resolved[group] = resolved = (HCPGroups(group, inner, sizes), comm)
        return resolved

    def _level0_group(self, sizes: tuple[int, ...], ranks: list[int], cp_rank: int) -> ProcessGroup:
        """This rank's all-to-all domain inside the sub-group: the start-up group of ``sizes[0]`` adjacent
        ranks, checked to be the one the hierarchy means."""
        want = [ranks[i] for i in level_members(sizes, 0, cp_rank)]
        try:
            inner = start_up_group_of_size(self.world_group, sizes[0])
            have = dist.get_process_group_ranks(inner)
        except (KeyError, AssertionError, ValueError, RuntimeError) as err:
            raise ValueError(f"no group of {sizes[0]} adjacent ranks for the all-to-all of a sub-group {ranks} "
                             f"({type(err).__name__}: {err}); initialise parallel_state with "
                             f"hybrid_context_parallel=True, which makes one per power of two") from None
        if have != want:
            raise ValueError(f"the all-to-all domain of rank {ranks[cp_rank]} in the sub-group {ranks} is ranks {want}, "
                             f"but the group of {sizes[0]} adjacent ranks holds {have}; sub-groups must be aligned "
                             f"runs of adjacent data x context parallel ranks (as megatron-core's hybrid groups are)")
        return inner
