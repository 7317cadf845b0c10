"""Our level-0 groups are megatron-core's (same ranks, also when TP strides the CP group), and we build
no group the engine does not use (the outer levels' ring runs inside the CP group)."""
import pytest
import torch.distributed as dist

import megatron_patches
from tests._dist import run_distributed
from tests.tiny_gpt import init_parallel


def _compare(rank, world, tp, sizes):
    from megatron.core import parallel_state as ps

    from mcp_context import HCPGroups, build_hcp_groups

    megatron_patches.apply_all(device="cpu")
    cp = world // tp
    init_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
    try:
        theirs = [dist.get_process_group_ranks(g) for g in ps.get_hierarchical_context_parallel_groups()]
        created = []
        new_group = dist.new_group
        dist.new_group = lambda *args, **kwargs: created.append(args) or new_group(*args, **kwargs)
        try:
            ours = build_hcp_groups(sizes, group=ps.get_context_parallel_group())
        finally:
            dist.new_group = new_group
        from_megatron = HCPGroups.from_megatron()
        return (theirs[0], dist.get_process_group_ranks(ours.inner_group),
                dist.get_process_group_ranks(from_megatron.inner_group), from_megatron.sizes,
                from_megatron.cp_global_ranks, len(created))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,sizes", [(1, [2, 2, 2]), (1, [4, 2]), (2, [2, 2])])
def test_levels_match_megatron_core(tp, sizes):
    per_rank = run_distributed(8, _compare, tp, sizes)
    for rank, (theirs, ours, read, read_sizes, cp_ranks, created) in enumerate(per_rank):
        assert ours == theirs == read, rank
        assert read_sizes == tuple(sizes)
        assert cp_ranks == [r for r in range(8) if r % tp == rank % tp]  # CP ranks strided by TP
        # Only level-0 groups: all of them when the CP group is the world, else just this rank's own.
        assert created == (8 // sizes[0] if tp == 1 else 1)
    if sizes == [2, 2, 2]:  # rank 0: level 0 = adjacent ranks
        assert per_rank[0][0] == [0, 1]


def _world_groups(rank, world, sizes):
    from mcp_context import build_hcp_groups

    created = []
    new_group = dist.new_group
    dist.new_group = lambda ranks, *args, **kwargs: created.append(list(ranks)) or new_group(ranks, *args, **kwargs)
    try:
        groups = build_hcp_groups(sizes)
    finally:
        dist.new_group = new_group
    return created, dist.get_process_group_ranks(groups.inner_group)


def test_over_the_world_only_the_level0_groups_are_created():
    for rank, (created, inner) in enumerate(run_distributed(8, _world_groups, [2, 2, 2])):
        assert created == [[0, 1], [2, 3], [4, 5], [6, 7]]  # every rank creates every level-0 group, in order
        assert inner == [rank - rank % 2, rank - rank % 2 + 1]
