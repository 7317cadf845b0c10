"""Process groups for hierarchical context parallelism: one group per level, inner level adjacent.

CP rank ``r`` has digits ``(r_0, r_1, ...)`` in the mixed radix of
``hierarchical_context_parallel_sizes`` with ``r_0`` varying fastest, so level 0 groups adjacent ranks
(one NVLink domain) and outer levels stride across them — megatron-core's
``create_hierarchical_groups`` convention, so groups built here and Megatron's agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..cp_rules import check_hcp_sizes


def level_members(sizes: Sequence[int], level: int, cp_rank: int) -> list[int]:
    """CP-rank indices of the level-``level`` group that contains ``cp_rank``."""
    stride = math.prod(sizes[:level])
    base = cp_rank - ((cp_rank // stride) % sizes[level]) * stride
    return [base + i * stride for i in range(sizes[level])]


@dataclass(frozen=True)
class HCPGroups:
    """The groups the engine communicates over: the CP group (ranks in CP-rank order; rings and
    all-gathers run here, with point-to-point sends to its ranks at any depth) and this rank's level-0
    group (the all-to-all of ``a2a+p2p``), with the hierarchy's ``sizes`` (inner first). Outer levels
    need no group of their own: the ring over them is driven inside the CP group."""

    cp_group: ProcessGroup
    inner_group: ProcessGroup
    sizes: tuple[int, ...]

    @property
    def cp_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)

    @property
    def cp_global_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.cp_group)

    @classmethod
    def flat(cls, group: Optional[ProcessGroup] = None) -> "HCPGroups":
        """A one-level hierarchy over ``group`` (default: the whole world)."""
        group = group or dist.group.WORLD
        return cls(group, group, (dist.get_world_size(group),))

    @classmethod
    def from_megatron(cls) -> "HCPGroups":
        """The groups megatron-core's ``parallel_state`` built (hierarchical ones when it has them)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("HCPGroups.from_megatron() needs megatron-core's parallel_state; call "
                               "parallel_state.initialize_model_parallel(...) first, or use build_hcp_groups")
        cp_group = ps.get_context_parallel_group()
        levels = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
        if not levels:
            return cls.flat(cp_group)
        sizes = tuple(dist.get_world_size(g) for g in levels)
        check_hcp_sizes(list(sizes), dist.get_world_size(cp_group))
        return cls(cp_group, levels[0], sizes)


def build_hcp_groups(sizes: Sequence[int], group: Optional[ProcessGroup] = None) -> HCPGroups:
    """The hierarchy ``sizes`` over the ranks of ``group`` (default: the whole world): builds the level-0
    groups (the only ones the engine uses; megatron-core's level-0 groups have the same ranks).

    ``sizes`` is inner-to-outer (``[2, 4]``: all-to-all pairs of adjacent ranks, a ring of 4). Every
    rank of ``group`` must call this, in the same order as its other group creations. Over the whole
    world every rank creates every level-0 group (plain ``new_group``, uniquely named). Over a subgroup
    (a CP group inside a larger job) only its members take part (``use_local_synchronization``), and
    torch names such groups after their ranks: build them once per subgroup and keep them.
    """
    cp_group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(cp_group)
    check_hcp_sizes(sizes, len(ranks))
    sizes = tuple(sizes)
    if len(sizes) == 1:
        return HCPGroups(cp_group, cp_group, sizes)
    cp_rank = dist.get_rank(cp_group)
    if group is None or len(ranks) == dist.get_world_size():
        inner = _own_group([[ranks[i] for i in level_members(sizes, 0, r)] for r in range(len(ranks))],
                           ranks[cp_rank])
    else:
        inner = dist.new_group([ranks[i] for i in level_members(sizes, 0, cp_rank)], use_local_synchronization=True)
    return HCPGroups(cp_group, inner, sizes)


def _own_group(member_lists: list[list[int]], rank: int) -> ProcessGroup:
    """Create every distinct group of ``member_lists`` (all ranks, same order); return ``rank``'s."""
    own = None
    for members in dict.fromkeys(tuple(m) for m in member_lists):
        created = dist.new_group(list(members))
        if rank in members:
            own = created
    return own
