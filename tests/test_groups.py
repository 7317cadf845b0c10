"""Our hierarchical groups are megatron-core's: same ranks per level, also when TP strides the CP group."""
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
        ours = build_hcp_groups(sizes, group=ps.get_context_parallel_group())
        from_megatron = HCPGroups.from_megatron()
        return (theirs, [dist.get_process_group_ranks(g) for g in ours.levels],
                [dist.get_process_group_ranks(g) for g in from_megatron.levels], from_megatron.sizes,
                from_megatron.cp_global_ranks)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,sizes", [(1, [2, 2, 2]), (1, [4, 2]), (2, [2, 2])])
def test_levels_match_megatron_core(tp, sizes):
    per_rank = run_distributed(8, _compare, tp, sizes)
    for rank, (theirs, ours, read, read_sizes, cp_ranks) in enumerate(per_rank):
        assert ours == theirs == read, rank
        assert read_sizes == tuple(sizes)
        assert cp_ranks == [r for r in range(8) if r % tp == rank % tp]  # CP ranks strided by TP
    if sizes == [2, 2, 2]:  # rank 0: level 0 = adjacent ranks, level 1 strides by 2, level 2 by 4
        assert per_rank[0][0] == [[0, 1], [0, 2], [0, 4]]
